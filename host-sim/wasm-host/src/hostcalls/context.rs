//! Contexts and the module's control calls: the effective context, foreign functions, `proxy_done`.

use super::{count, fault, give, read_str, st, C, ENV, S_OK};
use crate::abi::Status;
use crate::state::VmState;
use wasmtime::{Linker, Result};

/// Adds this group's host functions to `linker`.
pub fn add_to_linker(l: &mut Linker<VmState>) -> Result<()> {
    l.func_wrap(ENV, "proxy_set_effective_context", |mut c: C<'_>, id: i32| -> Result<i32> {
        count(&c, "proxy_set_effective_context");
        fault(&c, "proxy_set_effective_context")?;
        let d = c.data_mut();
        // Only contexts of the calling VM resolve, as in Envoy (contexts are per instance).
        if d.contexts.contains_key(&(id as u32)) {
            d.effective = id as u32;
            Ok(S_OK)
        } else {
            Ok(st(Status::BadArgument))
        }
    })?;
    l.func_wrap(
        ENV,
        "proxy_call_foreign_function",
        |mut c: C<'_>, np: i32, nn: i32, _ap: i32, _an: i32, pp: i32, sp: i32| -> Result<i32> {
            count(&c, "proxy_call_foreign_function");
            let name = tri!(read_str(&mut c, np, nn));
            match name.as_str() {
                // The route is always recomputed from the final headers in the simulation.
                "clear_route_cache" => give(&mut c, &[], pp, sp),
                _ => Ok(st(Status::NotFound)),
            }
        },
    )?;
    l.func_wrap(ENV, "proxy_done", |mut c: C<'_>| -> Result<i32> {
        count(&c, "proxy_done");
        c.data_mut().done_called = true;
        Ok(S_OK)
    })?;
    Ok(())
}
