//! `.context("what was being done")` for the stack's fallible steps: the error becomes
//! [`EngineError::Stack`] naming the step, with the original error as its source (kept whole,
//! not flattened into text). Crate-private: callers see [`EngineError`] only.

use crate::error::{EngineError, Result};

/// Attaches the step that failed to an error (see the [module docs](self)).
pub(crate) trait Context<T> {
    /// On error, a [`EngineError::Stack`] for `what` caused by the error.
    fn context(self, what: impl Into<String>) -> Result<T>;
    /// As [`context`](Self::context), with the step's text made only on error.
    fn with_context<S: Into<String>>(self, what: impl FnOnce() -> S) -> Result<T>;
}

impl<T, E: std::error::Error + Send + Sync + 'static> Context<T> for std::result::Result<T, E> {
    fn context(self, what: impl Into<String>) -> Result<T> {
        self.map_err(|e| EngineError::stack_caused(what, e))
    }

    fn with_context<S: Into<String>>(self, what: impl FnOnce() -> S) -> Result<T> {
        self.map_err(|e| EngineError::stack_caused(what(), e))
    }
}

impl<T> Context<T> for Option<T> {
    fn context(self, what: impl Into<String>) -> Result<T> {
        self.ok_or_else(|| EngineError::stack(what))
    }

    fn with_context<S: Into<String>>(self, what: impl FnOnce() -> S) -> Result<T> {
        self.ok_or_else(|| EngineError::stack(what()))
    }
}

/// Returns early with a [`EngineError::Stack`] made from a format string.
macro_rules! bail {
    ($($arg:tt)*) => {
        return Err($crate::error::EngineError::stack(format!($($arg)*)))
    };
}

/// A [`EngineError::Stack`] made from a format string.
macro_rules! stack_error {
    ($($arg:tt)*) => {
        $crate::error::EngineError::stack(format!($($arg)*))
    };
}

pub(crate) use {bail, stack_error};
