//! Logging: `proxy_log` into the process's log (dropped below the plugin's log level) and the level
//! the module reads.

use super::{count, read_str, st, write_u32, C, ENV, S_OK};
use crate::abi::LogLevel;
use crate::state::VmState;
use wasmtime::{Linker, Result};

/// Adds this group's host functions to `linker`.
pub fn add_to_linker(l: &mut Linker<VmState>) -> Result<()> {
    l.func_wrap(ENV, "proxy_log", |mut c: C<'_>, level: i32, p: i32, n: i32| -> Result<i32> {
        count(&c, "proxy_log");
        let msg = tri!(read_str(&mut c, p, n));
        c.data().log(LogLevel::from_abi(level), "proxy_log", msg);
        Ok(S_OK)
    })?;
    l.func_wrap(ENV, "proxy_get_log_level", |mut c: C<'_>, out: i32| -> Result<i32> {
        count(&c, "proxy_get_log_level");
        let lvl = c.data().proc.borrow().log_level.to_abi() as u32;
        tri!(write_u32(&mut c, out, lvl));
        Ok(S_OK)
    })?;
    Ok(())
}
