//! The NATS permissions each kvbm role needs, written once.
//!
//! One source for three readers, so that what is documented is what is tested:
//!
//! - `docs/security.md`'s sample server configuration (a test, `the_documented_grants_are_these`,
//!   checks each role's lines there against [`Grants::publish_line`] and
//!   [`Grants::subscribe_line`]);
//! - the authenticated test server `cargo xtask services` starts (xtask includes this file by
//!   path, which is why it uses `std` only), against which the `security_*` NATS tests and a
//!   real worker-process instance run;
//! - the subjects the code uses (`tests` check each grant against `membership::members_subject`
//!   and the workers' control subjects).
//!
//! The roles: an **instance** publishes and hears events, heartbeats and snapshots, and
//! answers snapshot requests; a **leader** drives its own instance's workers and hears their
//! beats; a **worker** hears its control subject, answers it and beats. Nothing grants
//! `_INBOX.>` publishing to a role that answers nothing (the server's "no responders" status
//! cannot be sealed).

/// One role's NATS permissions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Grants {
    /// Subjects the role may publish to.
    pub publish: Vec<String>,
    /// Subjects the role may subscribe to.
    pub subscribe: Vec<String>,
    /// Whether the role may publish replies to requests it received.
    pub allow_responses: bool,
}

impl Grants {
    /// An instance: events, heartbeats and snapshots under `events_subject` (every model
    /// fingerprint's), replies to the snapshot requests it answers.
    pub fn instance(events_subject: &str) -> Self {
        let events = [events_subject.to_owned(), format!("{events_subject}.>")];
        Self {
            publish: events.to_vec(),
            subscribe: [events.as_slice(), &["_INBOX.>".to_owned()]].concat(),
            allow_responses: true,
        }
    }

    /// The leader of `instance`: publishes to its own workers' control subjects, hears
    /// replies and its workers' beats.
    pub fn leader(control_prefix: &str, instance: u64) -> Self {
        Self {
            publish: vec![workers(control_prefix, instance)],
            subscribe: vec!["_INBOX.>".to_owned(), members(control_prefix, instance)],
            allow_responses: false,
        }
    }

    /// A worker of `instance` (every rank; name one rank's subject to narrow it): hears its
    /// control subject, answers it, beats on the members subject.
    pub fn worker(control_prefix: &str, instance: u64) -> Self {
        Self {
            publish: vec![members(control_prefix, instance)],
            subscribe: vec![workers(control_prefix, instance)],
            allow_responses: true,
        }
    }

    /// These grants with `subjects` added to both lists (a test's own subjects).
    pub fn with_subjects(mut self, subjects: &[&str]) -> Self {
        for s in subjects {
            self.publish.push((*s).to_owned());
            self.subscribe.push((*s).to_owned());
        }
        self
    }

    /// The role as one nats-server `permissions` value.
    pub fn to_conf(&self) -> String {
        let mut out = format!(
            "{{ publish: {{ allow: {} }}, subscribe: {{ allow: {} }}",
            list(&self.publish),
            list(&self.subscribe)
        );
        if self.allow_responses {
            out.push_str(", allow_responses: true");
        }
        out.push_str(" }");
        out
    }

    /// The `publish` line of the documented sample configuration.
    pub fn publish_line(&self) -> String {
        format!("publish:   {{ allow: {} }}", list(&self.publish))
    }

    /// The `subscribe` line of the documented sample configuration.
    pub fn subscribe_line(&self) -> String {
        format!("subscribe: {{ allow: {} }}", list(&self.subscribe))
    }
}

fn workers(prefix: &str, instance: u64) -> String {
    format!("{prefix}.{instance:016x}.worker.>")
}

fn members(prefix: &str, instance: u64) -> String {
    format!("{prefix}.{instance:016x}.members")
}

fn list(subjects: &[String]) -> String {
    let quoted: Vec<String> = subjects.iter().map(|s| format!("\"{s}\"")).collect();
    format!("[{}]", quoted.join(", "))
}

// The tests need the NATS-side modules (feature `nats`); xtask, which includes this file by
// path, has no such feature and so never compiles them. The path is explicit because a file
// included by path resolves its child modules as a `mod.rs` would (rustfmt follows it too).
#[cfg(all(test, feature = "nats"))]
#[path = "grants/tests.rs"]
mod tests;
