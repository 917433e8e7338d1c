//! `kvbm security`: the operator's side of the cluster's credentials.
//!
//! ```text
//!  kvbm security init  --out root.key            → the root key (0600), prints the trust root
//!  kvbm security issue --root root.key --instance ID --role leader|worker [--rank R]
//!                      --namespace NS [--valid-days D] --out member.cred
//!  kvbm security show  member.cred               → who the credential is for, its expiry and
//!                                                  its fingerprint
//!  kvbm security revoke --list revoked.txt (--credential member.cred | --fingerprint HEX
//!                      | --instance ID)          → one line appended to the revocation list
//! ```
//!
//! Credentials are short-lived by default (7 days): issue the next one before a member's
//! expires (members warn a day ahead, `security.expiry_warning_ms`). A member is removed at
//! once by the revocation list every member reads (`security.revoked_file`).
//!
//! The root key stays with the operator (never in a member's config). Every member's config
//! gets `security.trust_root` (the printed hex) and its own `security.credential_file`. The
//! threat model and the rest of the setup are in `docs/security.md`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use clap::Subcommand;
use kvbm_cluster::security::{Credential, Role, RootKey};
use kvbm_engine::InstanceId;

/// `kvbm security …`.
#[derive(Debug, Subcommand)]
pub(crate) enum SecurityCommand {
    /// Make the cluster's root key (written 0600, never overwritten) and print its public half
    /// for every member's `security.trust_root`.
    Init {
        /// Where to write the root key.
        #[arg(long, value_name = "FILE")]
        out: PathBuf,
    },
    /// Issue one member's credential, signed by the root key.
    Issue {
        /// The root key `init` wrote.
        #[arg(long, value_name = "FILE")]
        root: PathBuf,
        /// The instance id (decimal, or hex with 0x).
        #[arg(long)]
        instance: String,
        /// leader (an instance) or worker (one rank of it).
        #[arg(long)]
        role: Role,
        /// The worker's rank (leaders have none).
        #[arg(long, default_value_t = 0)]
        rank: u32,
        /// The tenant: members of different namespaces never accept each other's messages
        /// or blocks.
        #[arg(long)]
        namespace: String,
        /// Days the credential is valid (short-lived: issue the next one before it expires).
        #[arg(long, default_value_t = 7)]
        valid_days: u64,
        /// Where to write the credential (0600, never overwritten).
        #[arg(long, value_name = "FILE")]
        out: PathBuf,
    },
    /// Print who a credential is for, when it expires and its fingerprint (never its key).
    Show {
        /// The credential file.
        credential: PathBuf,
    },
    /// Append a revocation to the list every member reads (`security.revoked_file`; created
    /// 0644 if absent): one credential's certificate, or every certificate of an instance.
    Revoke {
        /// The revocation list.
        #[arg(long, value_name = "FILE")]
        list: PathBuf,
        /// Revoke this credential's certificate.
        #[arg(long, value_name = "FILE", conflicts_with_all = ["fingerprint", "instance"])]
        credential: Option<PathBuf>,
        /// Revoke the certificate with this fingerprint (as `show` prints it).
        #[arg(long, conflicts_with = "instance")]
        fingerprint: Option<String>,
        /// Revoke every certificate of this instance (decimal, or hex with 0x).
        #[arg(long)]
        instance: Option<String>,
    },
}

/// Runs one `kvbm security` command, returning what to print.
pub(crate) fn run(cmd: SecurityCommand) -> anyhow::Result<String> {
    match cmd {
        SecurityCommand::Init { out } => {
            let root = RootKey::generate()?;
            root.save(&out)?;
            Ok(format!(
                "root key written to {} (keep it off the members)\nsecurity.trust_root = \"{}\"\n",
                out.display(),
                root.trust_root().to_hex()
            ))
        }
        SecurityCommand::Issue {
            root,
            instance,
            role,
            rank,
            namespace,
            valid_days,
            out,
        } => {
            let key = RootKey::load(&root)?;
            let id = parse_instance(&instance)?;
            let cred = key.issue(
                id,
                role,
                rank,
                &namespace,
                Duration::from_secs(valid_days.saturating_mul(86_400)),
            )?;
            cred.save(&out)?;
            Ok(format!(
                "{} written to {}\nsecurity.trust_root = \"{}\"\nsecurity.credential_file = \"{}\"\nfingerprint = {}\n",
                cred.cert(),
                out.display(),
                key.trust_root().to_hex(),
                out.display(),
                cred.cert().fingerprint_hex()
            ))
        }
        SecurityCommand::Show { credential } => show(&credential),
        SecurityCommand::Revoke {
            list,
            credential,
            fingerprint,
            instance,
        } => revoke(&list, credential.as_deref(), fingerprint, instance),
    }
}

fn revoke(
    list: &Path,
    credential: Option<&Path>,
    fingerprint: Option<String>,
    instance: Option<String>,
) -> anyhow::Result<String> {
    use std::io::Write;
    let line = match (credential, fingerprint, instance) {
        (Some(c), None, None) => {
            let cred = Credential::load(c, None)?;
            format!("{}  # {}", cred.cert().fingerprint_hex(), cred.cert())
        }
        (None, Some(f), None) => {
            let f = f.trim().to_ascii_lowercase();
            if f.len() != 64 || !f.bytes().all(|b| b.is_ascii_hexdigit()) {
                anyhow::bail!("--fingerprint {f:?}: expected 64 hex digits (kvbm security show)");
            }
            f
        }
        (None, None, Some(i)) => format!("instance {:016x}", parse_instance(&i)?.0),
        _ => anyhow::bail!("name one of --credential, --fingerprint or --instance"),
    };
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(list)
        .with_context(|| format!("--list {}", list.display()))?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = file.metadata()?.permissions().mode();
        if mode & 0o022 != 0 {
            std::fs::set_permissions(list, std::fs::Permissions::from_mode(0o644))
                .with_context(|| format!("--list {}: chmod 644", list.display()))?;
        }
    }
    writeln!(file, "{line}").with_context(|| format!("--list {}", list.display()))?;
    Ok(format!(
        "{line}\nappended to {}: every member reading it (security.revoked_file) refuses it \
         within security.revocation_check_ms\n",
        list.display()
    ))
}

fn show(path: &Path) -> anyhow::Result<String> {
    let cred = Credential::load(path, None)?;
    let c = cred.cert();
    Ok(format!(
        "{}\ninstance = {:#x}\nrole = {}\nrank = {}\nnamespace = {:?}\nexpires = {} ms since the epoch\nfingerprint = {}\n",
        c,
        c.instance.0,
        c.role,
        c.rank,
        c.namespace,
        c.not_after_ms,
        c.fingerprint_hex()
    ))
}

fn parse_instance(s: &str) -> anyhow::Result<InstanceId> {
    let v = match s.strip_prefix("0x") {
        Some(h) => u64::from_str_radix(h, 16),
        None => s.parse(),
    }
    .with_context(|| format!("--instance {s:?}: expected a decimal or 0x-hex u64"))?;
    Ok(InstanceId(v))
}
