//! `.context("what was being done")` ([`Context`], in `error`) and the `bail!` /
//! `stack_error!` macros for the stack's fallible steps: the error becomes
//! [`EngineError::Stack`](crate::EngineError::Stack) naming the step, with the original error as
//! its source (kept whole, not flattened into text).

pub(crate) use crate::error::Context;

/// Returns early with a [`EngineError::Stack`](crate::EngineError::Stack) made from a format string.
macro_rules! bail {
    ($($arg:tt)*) => {
        return Err($crate::error::EngineError::stack(format!($($arg)*)))
    };
}

/// A [`EngineError::Stack`](crate::EngineError::Stack) made from a format string.
macro_rules! stack_error {
    ($($arg:tt)*) => {
        $crate::error::EngineError::stack(format!($($arg)*))
    };
}

pub(crate) use {bail, stack_error};
