//! The host functions a proxy-wasm ABI v0.2.1 module imports (module `env`) and the WASI
//! preview 1 functions a Rust `wasm32-wasip1` cdylib imports, written by hand so that time,
//! randomness and output are deterministic.
//!
//! One file per concern, each with an `add_to_linker` that defines its functions on a
//! `wasmtime::Linker` (the shape of wasmtime-wasi's `add_to_linker`); [`add_to_linker`] adds
//! them all. This file holds what they share: guest-memory access, handing bytes to the
//! module's allocator, and the injected-trap countdown.

use crate::abi::Status;
use crate::state::VmState;
use wasmtime::{Caller, Linker, Result};

type C<'a> = Caller<'a, VmState>;

const S_OK: i32 = Status::Ok as i32;

fn st(s: Status) -> i32 {
    s as i32
}

/// Counts a call of host function `name` in the process's [`crate::state::HostProfile`].
fn count(c: &C<'_>, name: &'static str) {
    *c.data().proc.borrow_mut().profile.host_calls.entry(name).or_default() += 1;
}

/// Copies `len` bytes at `ptr` out of the module's memory.
fn read(c: &mut C<'_>, ptr: i32, len: i32) -> std::result::Result<Vec<u8>, Status> {
    let (ptr, len) = (ptr as u32 as usize, len as u32 as usize);
    if len == 0 {
        return Ok(Vec::new());
    }
    c.data().proc.borrow_mut().profile.bytes_from_module += len as u64;
    let mem = c.data().memory.ok_or(Status::InvalidMemoryAccess)?;
    let data = mem.data(&*c);
    data.get(ptr..ptr.checked_add(len).ok_or(Status::InvalidMemoryAccess)?)
        .map(|s| s.to_vec())
        .ok_or(Status::InvalidMemoryAccess)
}

fn read_str(c: &mut C<'_>, ptr: i32, len: i32) -> std::result::Result<String, Status> {
    read(c, ptr, len).map(|b| String::from_utf8_lossy(&b).into_owned())
}

fn write(c: &mut C<'_>, ptr: i32, bytes: &[u8]) -> std::result::Result<(), Status> {
    let ptr = ptr as u32 as usize;
    let mem = c.data().memory.ok_or(Status::InvalidMemoryAccess)?;
    let data = mem.data_mut(&mut *c);
    let end = ptr.checked_add(bytes.len()).ok_or(Status::InvalidMemoryAccess)?;
    data.get_mut(ptr..end).ok_or(Status::InvalidMemoryAccess)?.copy_from_slice(bytes);
    Ok(())
}

fn write_u32(c: &mut C<'_>, ptr: i32, v: u32) -> std::result::Result<(), Status> {
    write(c, ptr, &v.to_le_bytes())
}

fn write_u64(c: &mut C<'_>, ptr: i32, v: u64) -> std::result::Result<(), Status> {
    write(c, ptr, &v.to_le_bytes())
}

/// Hands `bytes` to the module: allocates with its `proxy_on_memory_allocate`, copies, and
/// stores the pointer and size. Empty data is returned as a null pointer, which the SDKs read
/// as "no value". A trap inside the allocator propagates.
fn give(c: &mut C<'_>, bytes: &[u8], ptr_ptr: i32, size_ptr: i32) -> Result<i32> {
    let addr = if bytes.is_empty() {
        0
    } else {
        let Some(malloc) = c.data().malloc.clone() else {
            return Ok(st(Status::InternalFailure));
        };
        let addr = malloc.call(&mut *c, bytes.len() as i32)?;
        {
            let mut p = c.data().proc.borrow_mut();
            p.profile.bytes_to_module += bytes.len() as u64;
            p.profile.module_allocations += 1;
        }
        if addr == 0 {
            return Ok(st(Status::InternalFailure));
        }
        if let Err(s) = write(c, addr, bytes) {
            return Ok(st(s));
        }
        addr
    };
    if let Err(s) = write_u32(c, ptr_ptr, addr as u32).and_then(|_| write_u32(c, size_ptr, bytes.len() as u32)) {
        return Ok(st(s));
    }
    Ok(S_OK)
}

/// Message of a trap injected into a host call (fault injection, see `PluginSpec::trap_rate`).
pub const INJECTED_TRAP: &str = "injected fault: host call trapped";

/// Fault injection: when the running callback was armed to trap at its n-th host call, counts
/// down and traps there, as a crash inside the module at that point would.
fn fault(c: &C<'_>, call: &'static str) -> Result<()> {
    let d = c.data();
    match d.trap_in.get() {
        None => Ok(()),
        Some(0) => {
            d.trap_in.set(None);
            d.proc.borrow_mut().traps_injected += 1;
            Err(wasmtime::Error::msg(format!("{INJECTED_TRAP} ({call})")))
        }
        Some(n) => {
            d.trap_in.set(Some(n - 1));
            Ok(())
        }
    }
}

/// Unwraps a `Result<_, Status>` inside a host function, returning the status on error.
macro_rules! tri {
    ($e:expr) => {
        match $e {
            Ok(v) => v,
            Err(s) => return Ok(st(s)),
        }
    };
}

/// Import module of the proxy-wasm ABI's host functions.
const ENV: &str = "env";

pub mod buffers;
pub mod clock;
pub mod context;
pub mod headers;
pub mod http_call;
pub mod logging;
pub mod metrics;
pub mod properties;
pub mod shared_data;
pub mod shared_queue;
pub mod stream;
pub mod wasi;

/// Adds every host function (proxy-wasm `env` and WASI) to `linker`.
pub fn add_to_linker(linker: &mut Linker<VmState>) -> Result<()> {
    logging::add_to_linker(linker)?;
    clock::add_to_linker(linker)?;
    buffers::add_to_linker(linker)?;
    headers::add_to_linker(linker)?;
    properties::add_to_linker(linker)?;
    shared_data::add_to_linker(linker)?;
    shared_queue::add_to_linker(linker)?;
    stream::add_to_linker(linker)?;
    http_call::add_to_linker(linker)?;
    context::add_to_linker(linker)?;
    metrics::add_to_linker(linker)?;
    wasi::add_to_linker(linker)?;
    Ok(())
}
