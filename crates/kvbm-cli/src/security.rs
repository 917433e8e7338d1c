//! `kvbm security`: the operator's side of the cluster's credentials.
//!
//! ```text
//!  kvbm security init  --out root.key            → the root key (0600), prints the trust root
//!  kvbm security issue --root root.key --instance ID --role leader|worker [--rank R]
//!                      --namespace NS [--valid-days D] --out member.cred
//!  kvbm security show  member.cred               → who the credential is for, and its expiry
//! ```
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
        /// Days the credential is valid.
        #[arg(long, default_value_t = 365)]
        valid_days: u64,
        /// Where to write the credential (0600, never overwritten).
        #[arg(long, value_name = "FILE")]
        out: PathBuf,
    },
    /// Print who a credential is for and when it expires (never its key).
    Show {
        /// The credential file.
        credential: PathBuf,
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
                "{} written to {}\nsecurity.trust_root = \"{}\"\nsecurity.credential_file = \"{}\"\n",
                cred.cert(),
                out.display(),
                key.trust_root().to_hex(),
                out.display()
            ))
        }
        SecurityCommand::Show { credential } => show(&credential),
    }
}

fn show(path: &Path) -> anyhow::Result<String> {
    let cred = Credential::load(path, None)?;
    let c = cred.cert();
    Ok(format!(
        "{}\ninstance = {:#x}\nrole = {}\nrank = {}\nnamespace = {:?}\nexpires = {} ms since the epoch\n",
        c, c.instance.0, c.role, c.rank, c.namespace, c.not_after_ms
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
