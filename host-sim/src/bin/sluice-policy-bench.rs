//! Enqueue + dispatch throughput of every allocation policy, natively and
//! compiled to wasm and run through wasmtime, side by side in one run: the
//! workload is `sluice_policies::bench` in both, so the ratio is the cost of
//! running the filter's scheduling code as wasm.

use anyhow::{bail, Result};
use clap::Parser;
use sluice_policies::bench::{Workload, POLICIES, QUEUED, TENANTS};
use sluice_policies::order::{FeasibleSet, Fifo, FlowOrder};
use sluice_policies::spec::PolicySpec;
use std::path::PathBuf;
use std::time::Instant;
use wasmtime::{Engine, Linker, Module, Store, TypedFunc};

/// Policy throughput, native vs wasm (wasmtime).
#[derive(Parser)]
struct Args {
    /// The workload built as wasm: `cargo build -p sluice-bench-wasm --target wasm32-wasip1 --release`.
    #[arg(long, default_value = "target/wasm32-wasip1/release/sluice_bench_wasm.wasm")]
    wasm: PathBuf,
    /// Steps (one enqueue and one dispatch each) timed per policy.
    #[arg(long, default_value_t = 500_000)]
    steps: u64,
    /// A short run (50,000 steps).
    #[arg(long)]
    quick: bool,
}

/// The wasm side: one instance per measurement, so each starts from a fresh heap.
struct WasmBench {
    engine: Engine,
    pre: wasmtime::InstancePre<()>,
}

impl WasmBench {
    fn new(path: &PathBuf) -> Result<WasmBench> {
        let engine = Engine::default();
        let module = Module::from_file(&engine, path).map_err(|e| {
            anyhow::anyhow!(
                "loading {}: {e} (build it with `cargo build -p sluice-bench-wasm --target wasm32-wasip1 --release`)",
                path.display()
            )
        })?;
        let mut linker = Linker::new(&engine);
        // The workload calls no WASI function; any call would trap and fail the run loudly.
        linker.define_unknown_imports_as_traps(&module)?;
        let pre = linker.instantiate_pre(&module)?;
        Ok(WasmBench { engine, pre })
    }

    /// Ops/s of `steps` steps of policy `index`.
    fn measure(&self, index: usize, feasible: bool, steps: u64) -> Result<f64> {
        let mut store = Store::new(&self.engine, ());
        let instance = self.pre.instantiate(&mut store)?;
        if let Ok(init) = instance.get_typed_func::<(), ()>(&mut store, "_initialize") {
            init.call(&mut store, ())?;
        }
        let setup: TypedFunc<(u32, u32), u32> = instance.get_typed_func(&mut store, "setup")?;
        let run: TypedFunc<u64, ()> = instance.get_typed_func(&mut store, "run")?;
        if setup.call(&mut store, (index as u32, feasible as u32))? != 0 {
            bail!("the wasm module has no policy number {index}");
        }
        run.call(&mut store, steps / 10)?; // warm-up
        let start = Instant::now();
        run.call(&mut store, steps)?;
        Ok(2.0 * steps as f64 / start.elapsed().as_secs_f64())
    }
}

fn native(spec: &str, feasible: bool, steps: u64) -> Result<f64> {
    let policy = serde_json::from_str::<PolicySpec>(spec)?.build().map_err(anyhow::Error::msg)?;
    let order: Box<dyn FlowOrder> = if feasible { Box::new(FeasibleSet::default()) } else { Box::new(Fifo) };
    let mut w = Workload::new(policy, order);
    w.run(steps / 10); // warm-up
    let start = Instant::now();
    w.run(steps);
    Ok(2.0 * steps as f64 / start.elapsed().as_secs_f64())
}

fn main() -> Result<()> {
    let args = Args::parse();
    let steps = if args.quick { 50_000 } else { args.steps };
    let wasm = WasmBench::new(&args.wasm)?;
    println!("enqueue+dispatch, {QUEUED} queued over {TENANTS} tenants, {steps} steps (2 ops each)");
    println!("{:<14} {:>9} {:>14} {:>14} {:>12}", "policy", "order", "native ops/s", "wasm ops/s", "native/wasm");
    let rows = POLICIES.iter().enumerate().map(|(i, &(name, spec))| (i, name, spec, false));
    let feasible = std::iter::once((3, "vtc", POLICIES[3].1, true));
    for (i, name, spec, feasible) in rows.chain(feasible) {
        let steps = if feasible { steps / 5 } else { steps };
        let n = native(spec, feasible, steps)?;
        let w = wasm.measure(i, feasible, steps)?;
        let order = if feasible { "feasible" } else { "fifo" };
        println!("{name:<14} {order:>9} {n:>14.0} {w:>14.0} {:>11.2}x", n / w);
    }
    Ok(())
}
