//! Shared data: one map per process (one vm_id), one CAS counter.

use super::{count, fault, give, read, read_str, st, write_u32, C, ENV, S_OK};
use crate::abi::Status;
use crate::state::{SharedEntry, VmState};
use wasmtime::{Linker, Result};

/// Adds this group's host functions to `linker`.
pub fn add_to_linker(l: &mut Linker<VmState>) -> Result<()> {
    l.func_wrap(
        ENV,
        "proxy_get_shared_data",
        |mut c: C<'_>, kp: i32, kn: i32, pp: i32, sp: i32, cp: i32| -> Result<i32> {
            count(&c, "proxy_get_shared_data");
            fault(&c, "proxy_get_shared_data")?;
            let key = tri!(read_str(&mut c, kp, kn));
            let entry = c.data().proc.borrow().shared.get(&key).cloned();
            let Some(e) = entry else {
                return Ok(st(Status::NotFound));
            };
            c.data().proc.borrow_mut().profile.shared_bytes_read += e.value.len() as u64;
            tri!(write_u32(&mut c, cp, e.cas));
            give(&mut c, &e.value, pp, sp)
        },
    )?;
    l.func_wrap(
        ENV,
        "proxy_set_shared_data",
        |mut c: C<'_>, kp: i32, kn: i32, vp: i32, vn: i32, cas: i32| -> Result<i32> {
            count(&c, "proxy_set_shared_data");
            fault(&c, "proxy_set_shared_data")?;
            let key = tri!(read_str(&mut c, kp, kn));
            let value = tri!(read(&mut c, vp, vn));
            let mut p = c.data().proc.borrow_mut();
            p.profile.shared_bytes_written += value.len() as u64;
            // As in proxy-wasm-cpp-host: a CAS is checked only against an existing key; a
            // missing key is created whatever CAS was passed.
            if let Some(e) = p.shared.get(&key) {
                if cas != 0 && cas as u32 != e.cas {
                    return Ok(st(Status::CasMismatch));
                }
                if cas != 0 && p.inject_cas_conflict() {
                    // Another worker wrote the key between this VM's get and set (threads run
                    // in parallel in Envoy, not here): same value, new version.
                    let bumped = p.next_cas();
                    p.shared.get_mut(&key).expect("present").cas = bumped;
                    p.cas_conflicts_injected += 1;
                    return Ok(st(Status::CasMismatch));
                }
            }
            let cas = p.next_cas();
            p.shared.insert(key, SharedEntry { value, cas });
            Ok(S_OK)
        },
    )?;

    Ok(())
}
