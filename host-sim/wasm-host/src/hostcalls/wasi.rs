//! WASI preview 1, the part a Rust `wasm32-wasip1` cdylib imports, by hand so that time,
//! randomness and output are deterministic: stdout and stderr go to the log, clocks read the
//! virtual clock, `random_get` reads the process's seeded stream; no files, environment or
//! arguments; `proc_exit` traps.

use super::{read, write, write_u32, write_u64, C};
use crate::abi::LogLevel;
use crate::state::{VmState, EPOCH_NS};
use wasmtime::{Linker, Result};
/// WASI errno values used below.
mod errno {
    pub const SUCCESS: i32 = 0;
    pub const BADF: i32 = 8;
    pub const FAULT: i32 = 21;
    pub const INVAL: i32 = 28;
    pub const NOSYS: i32 = 52;
    pub const SPIPE: i32 = 70;
}

/// Adds the WASI functions to `linker`.
pub fn add_to_linker(l: &mut Linker<VmState>) -> Result<()> {
    const W: &str = "wasi_snapshot_preview1";
    l.func_wrap(W, "fd_write", |mut c: C<'_>, fd: i32, iovs: i32, n: i32, out: i32| -> Result<i32> {
        if fd != 1 && fd != 2 {
            return Ok(errno::BADF);
        }
        let Ok(vec) = read(&mut c, iovs, n.saturating_mul(8)) else {
            return Ok(errno::FAULT);
        };
        let mut text = Vec::new();
        for iov in vec.chunks_exact(8) {
            let p = i32::from_le_bytes(iov[0..4].try_into().unwrap());
            let len = i32::from_le_bytes(iov[4..8].try_into().unwrap());
            let Ok(b) = read(&mut c, p, len) else {
                return Ok(errno::FAULT);
            };
            text.extend_from_slice(&b);
        }
        let written = text.len() as u32;
        let msg = String::from_utf8_lossy(&text).trim_end().to_string();
        if !msg.is_empty() {
            let (lvl, src) = if fd == 1 { (LogLevel::Info, "stdout") } else { (LogLevel::Error, "stderr") };
            c.data().log(lvl, src, msg);
        }
        if write_u32(&mut c, out, written).is_err() {
            return Ok(errno::FAULT);
        }
        Ok(errno::SUCCESS)
    })?;
    l.func_wrap(W, "fd_read", |_c: C<'_>, _: i32, _: i32, _: i32, _: i32| -> Result<i32> { Ok(errno::BADF) })?;
    l.func_wrap(W, "fd_close", |_c: C<'_>, _: i32| -> Result<i32> { Ok(errno::BADF) })?;
    l.func_wrap(W, "fd_seek", |_c: C<'_>, _: i32, _: i64, _: i32, _: i32| -> Result<i32> { Ok(errno::SPIPE) })?;
    l.func_wrap(W, "fd_fdstat_get", |mut c: C<'_>, fd: i32, out: i32| -> Result<i32> {
        if !(0..=2).contains(&fd) {
            return Ok(errno::BADF);
        }
        // filetype character_device (2), no flags, all rights.
        let mut st = [0u8; 24];
        st[0] = 2;
        st[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        Ok(if write(&mut c, out, &st).is_ok() { errno::SUCCESS } else { errno::FAULT })
    })?;
    l.func_wrap(W, "fd_prestat_get", |_c: C<'_>, _: i32, _: i32| -> Result<i32> { Ok(errno::BADF) })?;
    l.func_wrap(W, "fd_prestat_dir_name", |_c: C<'_>, _: i32, _: i32, _: i32| -> Result<i32> { Ok(errno::BADF) })?;
    fn zero_sizes(c: &mut C<'_>, a: i32, b: i32) -> i32 {
        if write_u32(c, a, 0).and_then(|_| write_u32(c, b, 0)).is_ok() {
            errno::SUCCESS
        } else {
            errno::FAULT
        }
    }
    l.func_wrap(W, "environ_sizes_get", |mut c: C<'_>, a: i32, b: i32| -> Result<i32> {
        Ok(zero_sizes(&mut c, a, b))
    })?;
    l.func_wrap(W, "environ_get", |_c: C<'_>, _: i32, _: i32| -> Result<i32> { Ok(errno::SUCCESS) })?;
    l.func_wrap(W, "args_sizes_get", |mut c: C<'_>, a: i32, b: i32| -> Result<i32> { Ok(zero_sizes(&mut c, a, b)) })?;
    l.func_wrap(W, "args_get", |_c: C<'_>, _: i32, _: i32| -> Result<i32> { Ok(errno::SUCCESS) })?;
    l.func_wrap(W, "clock_time_get", |mut c: C<'_>, id: i32, _prec: i64, out: i32| -> Result<i32> {
        let now_ns = c.data().proc.borrow().now_us * 1000;
        let v = match id {
            0 => EPOCH_NS + now_ns,
            1..=3 => now_ns,
            _ => return Ok(errno::INVAL),
        };
        Ok(if write_u64(&mut c, out, v).is_ok() { errno::SUCCESS } else { errno::FAULT })
    })?;
    l.func_wrap(W, "clock_res_get", |mut c: C<'_>, id: i32, out: i32| -> Result<i32> {
        if !(0..=3).contains(&id) {
            return Ok(errno::INVAL);
        }
        Ok(if write_u64(&mut c, out, 1000).is_ok() { errno::SUCCESS } else { errno::FAULT })
    })?;
    l.func_wrap(W, "random_get", |mut c: C<'_>, p: i32, n: i32| -> Result<i32> {
        let mut buf = vec![0u8; n as u32 as usize];
        c.data().proc.borrow_mut().fill_random(&mut buf);
        Ok(if write(&mut c, p, &buf).is_ok() { errno::SUCCESS } else { errno::FAULT })
    })?;
    l.func_wrap(W, "sched_yield", |_c: C<'_>| -> Result<i32> { Ok(errno::SUCCESS) })?;
    l.func_wrap(W, "poll_oneoff", |_c: C<'_>, _: i32, _: i32, _: i32, _: i32| -> Result<i32> { Ok(errno::NOSYS) })?;
    l.func_wrap(W, "proc_exit", |_c: C<'_>, code: i32| -> Result<()> {
        Err(wasmtime::Error::msg(format!("module called proc_exit({code})")))
    })?;
    l.func_wrap(W, "proc_raise", |_c: C<'_>, _: i32| -> Result<i32> { Ok(errno::NOSYS) })?;
    Ok(())
}
