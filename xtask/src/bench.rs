//! `cargo xtask bench [NAME]`: runs the criterion benchmarks and `kvbm bench` figures.
//!
//! `NAME` selects one crate (`logical` → `kvbm-logical`); with none, every crate that has
//! benchmarks runs. Benchmarks always build in release mode; they never run inside `ci`.
//! Benchmarks that need servers (G4) get them from [`crate::services`].
//!
//! `bench tiering --against REV [--runs N] [-- ARGS]` compares the tiering bench of the working
//! tree with revision `REV`'s, run alternately; `bench vllm --against REV` the scheduler step
//! driven from Python ([`crate::bench_ab`]).

use std::process::Command;

use anyhow::{Result, bail};

use crate::run_step;

/// Crates with benchmarks, by short name.
const BENCHED: &[(&str, &str)] = &[
    ("logical", "kvbm-logical"),
    ("physical", "kvbm-physical"),
    ("offload", "kvbm-offload"),
    ("tiering", "kvbm-tiering"),
    ("engine", "kvbm-engine"),
    ("cluster", "kvbm-cluster"),
];

pub(crate) fn run(args: &[String]) -> Result<()> {
    if let Some(ab) = crate::bench_ab::Ab::parse(args)? {
        return crate::bench_ab::run(&ab);
    }
    let selected: Vec<&(&str, &str)> = match args.first() {
        None => BENCHED.iter().collect(),
        Some(name) => match BENCHED
            .iter()
            .find(|(short, krate)| short == name || krate == name)
        {
            Some(found) => vec![found],
            None => bail!(
                "no benchmarks named `{name}`; known: {}",
                BENCHED
                    .iter()
                    .map(|(s, _)| *s)
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        },
    };
    let services = crate::services::Services::start_for_benches()?;
    let mut result = Ok(());
    for (_, krate) in selected {
        let mut cmd = Command::new("cargo");
        cmd.args(["bench", "-p", krate]);
        if *krate == "kvbm-cluster" {
            // Its instance and fleet benches need the NATS plane.
            cmd.args(["--features", "nats"]);
        }
        cmd.args(args.get(1..).unwrap_or_default());
        services.export_to(&mut cmd);
        if let Err(e) = run_step(&mut cmd) {
            result = Err(e);
            break;
        }
    }
    services.stop();
    result
}
