//! Empty: this package only hosts the comparison benchmark.
