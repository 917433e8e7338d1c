//! The `kvbm` command line.
//!
//! `kvbm replay` replays a request trace through the tiered cache; `kvbm bench` runs benchmarks.
//! Until the replay issue lands, `replay` says so plainly instead of pretending to work.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// kvbm: a multi-tier KV-cache block manager for LLM inference.
#[derive(Debug, Parser)]
#[command(name = "kvbm", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Replay a request trace through the tiered cache (embedded default trace when none is given).
    Replay {
        /// Path to a Mooncake-format JSONL trace; the embedded default is used when omitted.
        #[arg(long)]
        trace: Option<std::path::PathBuf>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Replay { trace } => {
            let which = trace
                .as_deref()
                .map(|p| p.display().to_string())
                .unwrap_or_else(|| "the embedded default trace".to_string());
            eprintln!(
                "kvbm replay: not yet built. Trace replay over {which} arrives with the replay issue; \
                 the layers it needs (logical, physical, offload) are being built first."
            );
            ExitCode::from(2)
        }
    }
}
