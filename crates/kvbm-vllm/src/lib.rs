#![doc = include_str!("../README.md")]

mod bridge;
mod core;
mod cpu;
mod direct;
mod entry;
mod logbridge;
mod tiering;
mod tiers;

use pyo3::prelude::*;

/// The extension module `kvbm_vllm._kvbm`. The Python package imports it lazily: vLLM's metrics
/// front end imports the spec classes without running a manager, and must not pay for it.
#[pymodule]
fn _kvbm(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    logbridge::install();
    m.add("ContractError", m.py().get_type::<bridge::ContractError>())?;
    m.add_class::<cpu::CpuManager>()?;
    m.add_class::<tiers::StorageTier>()?;
    m.add_class::<tiers::Probe>()?;
    m.add_class::<tiering::TieringManager>()?;
    m.add_class::<tiering::Parent>()?;
    m.add_class::<direct::DirectManager>()?;
    m.add_class::<direct::DirectWorker>()?;
    Ok(())
}
