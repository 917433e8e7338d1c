//! G4 shared between instances over NATS: the cluster plane's side of the stack's
//! [`ShareG4`] seam. Each instance's G4 stored/removed events go out over NATS, and every
//! instance's leader finds the others' G4 blocks through its [`CrossInstanceIndex`] (adopted
//! into its own G4, read from the shared store).
//!
//! ```text
//!  build: connect ─► NatsBus ─► EventPublisher (this G4's events out)
//!                           └─► CrossInstanceIndex::follow (the others' events in)
//!         ... every tier built ...
//!         ready barrier: announce on <subject>.ready until every instance is heard
//! ```
//!
//! The ready announcements are sealed like every other message (context `ready:<subject>`):
//! with security on, an announcement counts only when a leader's certificate sealed it and
//! names the instance it announces, so a non-member (or a member speaking for another
//! instance) cannot start a run before every instance is subscribed.
//!
//! Every subject is the configured one scoped by the stack's model fingerprint
//! (`<subject>.fp-<hex>`): instances of another model, dtype, layout or rank are never heard
//! (their G4 objects live under another prefix too), and a run whose instances disagree on it
//! fails its ready barrier instead of sharing.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvbm_logical::{EventSink, SequenceHash};
use parking_lot::Mutex;

use crate::pubsub::nats::NatsBus;
use crate::pubsub::{EventPublisher, IndexEvents};
use crate::security::{Rejection, Role, Security};
use kvbm_engine::InstanceId;
use kvbm_engine::config::{check_nats_url, redact_url};
use kvbm_engine::cross_instance::CrossInstanceIndex;
use kvbm_engine::error::Context;
use kvbm_engine::error::{EngineError, Result};
use kvbm_engine::leader::RemoteSearch;
use kvbm_engine::runtime::KvbmRuntime;
use kvbm_engine::stack::{ShareG4, SharedG4};

/// One instance of several: G4 is shared with the others, its events over NATS. Set it as the
/// stack's [`StackPlan::sharing`](kvbm_engine::stack::StackPlan::sharing).
#[derive(Debug, Clone)]
pub struct Sharing {
    /// The NATS server.
    pub nats_url: String,
    /// The subject every instance of this run publishes and subscribes on (scoped by the
    /// model fingerprint when joined).
    pub subject: String,
    /// This instance's id (distinct per instance, not 0).
    pub instance: u64,
    /// Instances in the run: each waits for all of them to be subscribed before it starts.
    pub instances: usize,
}

impl ShareG4 for Sharing {
    fn join(
        &self,
        runtime: &KvbmRuntime,
        fingerprint: &kvbm_physical::ModelFingerprint,
    ) -> Result<Box<dyn SharedG4>> {
        let scoped = Sharing {
            subject: format!("{}.{}", self.subject, fingerprint.key_segment()),
            ..self.clone()
        };
        Ok(Box::new(NatsSharedG4::start(runtime, &scoped)?))
    }
}

/// A started share of G4: the bus, this instance's publisher, the others' index.
struct NatsSharedG4 {
    /// Hashes this instance wrote to G4 (or found there at start): a G4 hit on any other
    /// hash is a block another instance wrote.
    own: Arc<Mutex<HashSet<SequenceHash>>>,
    /// Where this instance's G4 events go.
    publisher: Arc<EventPublisher>,
    /// Every instance's G4 blocks, from their events.
    index: Arc<CrossInstanceIndex>,
    /// This instance.
    this: InstanceId,
    client: async_nats::Client,
    sharing: Sharing,
    /// Seals and opens the ready announcements.
    security: Arc<Security>,
    _bus: Arc<NatsBus>,
}

impl NatsSharedG4 {
    /// Connects to NATS and starts the event bus, the publisher and the cross-instance index.
    ///
    /// # Errors
    /// The server does not answer within 15 s, or a subscription fails.
    fn start(runtime: &KvbmRuntime, s: &Sharing) -> Result<Self> {
        let h = runtime.handle();
        let config = runtime.config();
        let capacity = config.events.channel_capacity;
        // Secure by default: never without member credentials (loopback too), nor off
        // loopback without NATS credentials, unless `security.insecure`.
        check_nats_url("transport.nats_url", &s.nats_url)?;
        let security = Arc::new(Security::from_config(
            &config.security.for_instance(InstanceId(s.instance)),
        )?);
        security.require_for(config.security.insecure, [s.nats_url.as_str()])?;
        // With a credential, this instance is the one it names: its event batches are sealed
        // as that leader's, and every batch it follows must be sealed by the instance it names.
        if let Some(signer) = security.signer()
            && signer.cert().instance != InstanceId(s.instance)
        {
            return Err(EngineError::config(
                "security.credential_file",
                format!(
                    "the credential is for {}, this instance is {}",
                    signer.cert(),
                    InstanceId(s.instance)
                ),
            ));
        }
        config
            .transport
            .nats_auth
            .require_for(&s.nats_url, config.security.insecure)?;
        let server = redact_url(&s.nats_url);
        let (bus, client) = h
            .tokio()
            .block_on(async {
                tokio::time::timeout(Duration::from_secs(15), async {
                    let client = crate::transport::nats::connect_with(
                        &s.nats_url,
                        &runtime.config().transport.nats_auth,
                        &format!("kvbm-replay-{}", s.instance),
                        Duration::from_secs(1),
                    )
                    .await?;
                    let bus = NatsBus::start_secured(
                        &h,
                        h.shutdown_token(),
                        client.clone(),
                        s.subject.clone(),
                        capacity,
                        security.clone(),
                    )
                    .await?;
                    Ok::<_, EngineError>((bus, client))
                })
                .await
            })
            .map_err(|_| {
                EngineError::stack(format!("NATS server {server} did not answer within 15 s"))
            })?
            .with_context(|| format!("cannot reach the NATS server {server}"))?;
        let this = InstanceId(s.instance);
        let publisher = EventPublisher::spawn(&h, this, bus.clone())
            .context("cannot start the event publisher")?;
        let index = Arc::new(CrossInstanceIndex::with_cap(
            runtime.config().transport.snapshot_max_entries,
        ));
        CrossInstanceIndex::follow(index.clone(), &h, &*bus)
            .context("cannot follow the cross-instance events")?;
        Ok(NatsSharedG4 {
            own: Arc::default(),
            publisher,
            index,
            this,
            client,
            sharing: s.clone(),
            security,
            _bus: bus,
        })
    }
}

impl SharedG4 for NatsSharedG4 {
    fn own(&self) -> &Arc<Mutex<HashSet<SequenceHash>>> {
        &self.own
    }

    /// How the leader searches the other instances' G4 blocks.
    fn remote(&self) -> RemoteSearch {
        RemoteSearch {
            index: self.index.clone(),
            this: self.this,
            shared_g4: true,
            remote_g2: true,
        }
    }

    /// The sink G4's manager publishes its events to.
    fn sink(&self) -> Arc<dyn EventSink> {
        self.publisher.clone()
    }

    /// Waits for every other instance of the run (see [`ready_barrier`]).
    ///
    /// # Errors
    /// As [`ready_barrier`].
    fn wait_for_all(&self, rt: &tokio::runtime::Handle) -> Result<()> {
        let s = &self.sharing;
        rt.block_on(ready_barrier(
            &self.client,
            &s.subject,
            s.instance,
            s.instances,
            &self.security,
            READY_DEADLINE,
        ))
        .context("waiting for the other instances")
    }
}

/// How long [`ready_barrier`] waits for every instance.
const READY_DEADLINE: Duration = Duration::from_secs(60);

/// Waits until every instance of the run is subscribed to the events (NATS does not replay
/// what was published before a subscription, so an instance that started serving early could
/// publish blocks a slower one never hears of). Each instance announces itself on
/// `<subject>.ready` every 50 ms until it has heard all `count`, then once more. Why that is
/// enough: an instance announces only after subscribing, so whoever has heard everyone knows
/// everyone is subscribed, and its last announcement reaches them all.
///
/// Announcements are sealed by `security` (context `ready:<subject>`); one that does not open,
/// or whose sealing certificate is not a leader of the instance it names, is dropped and
/// counted ([`Rejection::NotAllowed`](crate::security::Rejection::NotAllowed) for the latter).
async fn ready_barrier(
    client: &async_nats::Client,
    subject: &str,
    me: u64,
    count: usize,
    security: &Security,
    deadline: Duration,
) -> Result<()> {
    use futures::StreamExt;
    let subject = format!("{subject}.ready");
    let nats = |e: &dyn std::fmt::Display| EngineError::Nats {
        url: subject.clone(),
        message: e.to_string(),
    };
    let mut sub = client
        .subscribe(subject.clone())
        .await
        .map_err(|e| nats(&e))?;
    client.flush().await.map_err(|e| nats(&e))?;
    let context = format!("ready:{subject}");
    let mut seen = HashSet::new();
    let until = Instant::now() + deadline;
    loop {
        // Sealed afresh each time: a receiver takes each sequence number once and only within
        // the clock-skew window, and an instance may join the run late.
        let announcement = security.seal(context.as_bytes(), me.to_string().as_bytes());
        client
            .publish(subject.clone(), announcement.into())
            .await
            .map_err(|e| nats(&e))?;
        client.flush().await.map_err(|e| nats(&e))?;
        if seen.len() >= count {
            return Ok(());
        }
        if Instant::now() > until {
            return Err(EngineError::stack(format!(
                "only {} of {count} instances announced themselves within {} s",
                seen.len(),
                deadline.as_secs_f64()
            )));
        }
        let tick = tokio::time::sleep(Duration::from_millis(50));
        tokio::pin!(tick);
        loop {
            tokio::select! {
                m = sub.next() => match m {
                    Some(m) => {
                        if let Some(id) = announced(security, context.as_bytes(), &m.payload) {
                            seen.insert(id);
                        }
                    }
                    None => {
                        return Err(EngineError::stack(format!(
                            "the NATS subscription for {subject} ended"
                        )));
                    }
                },
                () = &mut tick => break,
            }
        }
    }
}

/// The instance a ready announcement names, if it opens under `security` and (security on) a
/// leader of that instance sealed it; else `None` (counted when security refused it).
fn announced(security: &Security, context: &[u8], bytes: &[u8]) -> Option<u64> {
    let (sender, payload) = security.open(context, bytes).ok()?;
    let id = std::str::from_utf8(payload).ok()?.parse::<u64>().ok()?;
    match sender {
        Some(cert) if cert.instance != InstanceId(id) || cert.role != Role::Leader => {
            security.count(Rejection::NotAllowed);
            None
        }
        _ => Some(id),
    }
}

#[cfg(test)]
mod tests;
