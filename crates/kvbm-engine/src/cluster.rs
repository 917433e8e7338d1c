//! The cluster plane: how instances and their worker ranks find and talk to each other. It
//! builds on the engine's core (the stack, the leader, sessions, moves) and fills the core's
//! seams; the core never imports it (`cargo xtask layering` checks).
//!
//! ```text
//!            core seam                        filled here by
//!  ParallelWorkers (worker)        ◄── transport::control::ControlledWorkers (+ transport::nats)
//!  CrossInstanceIndex (cross_instance) ◄── pubsub: EventPublisher, EventBus, NatsBus, follow
//!  RemotePull (cross_instance)     ◄── dataplane::DataPlaneClient (TCP)
//!  ShareG4 (stack)                 ◄── shared_g4::Sharing (NATS)
//!  composition                     ◄── instance::Instance, presence (the binaries run it)
//! ```
//!
//! Every message from the network is input, never trusted: versioned, bounded, checked against
//! the block's identity before a byte is served.

pub mod dataplane;
#[doc(hidden)]
pub mod fuzzing;
#[cfg(feature = "nats")]
pub mod instance;
pub mod pubsub;
#[cfg(feature = "nats")]
pub mod shared_g4;
pub mod transport;
