#![doc = include_str!("../README.md")]

pub mod dataplane;
#[cfg(feature = "nats")]
pub mod fleet;
#[doc(hidden)]
pub mod fuzzing;
#[cfg(feature = "nats")]
pub mod instance;
pub mod pubsub;
pub mod security;
#[cfg(feature = "nats")]
pub mod shared_g4;
#[cfg(feature = "testing")]
pub mod testing;
pub mod transport;
