//! The clock and timers: the virtual wall clock the module reads, and the tick period of its root
//! context (ticks are the embedder's to run).

use super::{count, fault, st, write_u64, C, ENV, S_OK};
use crate::state::{VmState, EPOCH_NS};
use wasmtime::{Linker, Result};

/// Adds this group's host functions to `linker`.
pub fn add_to_linker(l: &mut Linker<VmState>) -> Result<()> {
    l.func_wrap(ENV, "proxy_get_current_time_nanoseconds", |mut c: C<'_>, out: i32| -> Result<i32> {
        count(&c, "proxy_get_current_time_nanoseconds");
        fault(&c, "proxy_get_current_time_nanoseconds")?;
        let now = EPOCH_NS + c.data().proc.borrow().now_us * 1000;
        tri!(write_u64(&mut c, out, now));
        Ok(S_OK)
    })?;
    l.func_wrap(ENV, "proxy_set_tick_period_milliseconds", |mut c: C<'_>, ms: i32| -> Result<i32> {
        count(&c, "proxy_set_tick_period_milliseconds");
        c.data_mut().tick_period_ms = ms as u32;
        Ok(S_OK)
    })?;
    Ok(())
}
