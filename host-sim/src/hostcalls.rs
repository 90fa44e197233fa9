//! The host functions a proxy-wasm ABI v0.2.1 module imports (module `env`) and the WASI
//! preview 1 functions a Rust `wasm32-wasip1` cdylib imports, written by hand so that time,
//! randomness and output are deterministic.

use crate::abi::{self, buffer_type, map_type, metric_type, stream_type, HeaderMap, LogLevel, Status};
use crate::state::{
    Cluster, Context, HttpCallOut, Metric, QueuePost, SharedEntry, SharedQueue, StreamAction, VmState, EPOCH_NS,
};
use wasmtime::{Caller, Linker, Result};

type C<'a> = Caller<'a, VmState>;

const S_OK: i32 = Status::Ok as i32;

fn st(s: Status) -> i32 {
    s as i32
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

/// Counts a call of host function `name` in the process's [`crate::state::HostProfile`].
fn count(c: &C<'_>, name: &'static str) {
    *c.data().proc.borrow_mut().profile.host_calls.entry(name).or_default() += 1;
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

fn map_ref(c: &mut C<'_>, t: i32) -> Option<HeaderMap> {
    let d = c.data_mut();
    if t == map_type::HTTP_CALL_RESPONSE_HEADERS {
        return d.call_response.as_ref().map(|r| r.0.clone());
    }
    if t == map_type::HTTP_CALL_RESPONSE_TRAILERS {
        return d.call_response.as_ref().map(|r| r.2.clone());
    }
    let s = d.stream()?;
    match t {
        map_type::REQUEST_HEADERS => Some(s.request_headers.clone()),
        map_type::REQUEST_TRAILERS => s.request_trailers.clone(),
        map_type::RESPONSE_HEADERS => s.response_headers.clone(),
        map_type::RESPONSE_TRAILERS => s.response_trailers.clone(),
        _ => None,
    }
}

/// Applies `f` to a mutable header map of the effective stream. Trailers that have not arrived
/// are created, as Envoy lets a filter add trailers at end of stream.
fn with_map<R>(c: &mut C<'_>, t: i32, f: impl FnOnce(&mut HeaderMap) -> R) -> std::result::Result<R, Status> {
    let d = c.data_mut();
    if t == map_type::HTTP_CALL_RESPONSE_HEADERS || t == map_type::HTTP_CALL_RESPONSE_TRAILERS {
        let r = d.call_response.as_mut().ok_or(Status::NotFound)?;
        return Ok(f(if t == map_type::HTTP_CALL_RESPONSE_HEADERS { &mut r.0 } else { &mut r.2 }));
    }
    let s = d.stream().ok_or(Status::BadArgument)?;
    let m = match t {
        map_type::REQUEST_HEADERS => &mut s.request_headers,
        map_type::REQUEST_TRAILERS => s.request_trailers.get_or_insert_with(Vec::new),
        map_type::RESPONSE_HEADERS => s.response_headers.as_mut().ok_or(Status::NotFound)?,
        map_type::RESPONSE_TRAILERS => s.response_trailers.get_or_insert_with(Vec::new),
        _ => return Err(Status::BadArgument),
    };
    Ok(f(m))
}

fn buffer_ref(c: &mut C<'_>, t: i32) -> Option<Vec<u8>> {
    let d = c.data_mut();
    match t {
        buffer_type::VM_CONFIGURATION => Some(d.vm_configuration.clone()),
        buffer_type::PLUGIN_CONFIGURATION => Some(d.plugin_configuration.clone()),
        buffer_type::HTTP_CALL_RESPONSE_BODY => d.call_response.as_ref().map(|r| r.1.clone()),
        buffer_type::REQUEST_BODY => d.stream().map(|s| s.request_body.clone()),
        buffer_type::RESPONSE_BODY => d.stream().map(|s| s.response_body.clone()),
        _ => None,
    }
}

fn property(c: &mut C<'_>, path: &str) -> Option<Vec<u8>> {
    let d = c.data_mut();
    let local = match d.contexts.get(&d.effective) {
        Some(Context::Http(s)) => s.properties.get(path).cloned().or_else(|| stream_property(s, path)),
        Some(Context::Root { properties }) => properties.get(path).cloned(),
        None => None,
    };
    if local.is_some() {
        return local;
    }
    let p = d.proc.borrow();
    match path {
        "plugin_name" => Some(p.plugin_name.clone().into_bytes()),
        "plugin_root_id" => Some(p.root_id.clone().into_bytes()),
        "plugin_vm_id" => Some(p.vm_id.clone().into_bytes()),
        _ => p.properties.get(path).cloned(),
    }
}

/// Properties Envoy derives from the request itself (strings raw, integers as 8-byte LE).
fn stream_property(s: &crate::state::StreamData, path: &str) -> Option<Vec<u8>> {
    let h = |n: &str| abi::header(&s.request_headers, n).map(|v| v.to_vec());
    match path {
        "request.path" => h(":path"),
        "request.url_path" => h(":path").map(|p| p.split(|b| *b == b'?').next().unwrap_or(&[]).to_vec()),
        "request.method" => h(":method"),
        "request.host" => h(":authority"),
        "request.scheme" => h(":scheme"),
        "request.id" => h("x-request-id"),
        "request.protocol" => Some(b"HTTP/1.1".to_vec()),
        "response.code" => s
            .response_headers
            .as_ref()
            .and_then(|r| abi::header_str(r, ":status"))
            .and_then(|v| v.parse::<i64>().ok())
            .map(|v| v.to_le_bytes().to_vec()),
        _ => None,
    }
}

/// Registers every host function on `linker`.
pub(crate) fn register(linker: &mut Linker<VmState>) -> Result<()> {
    register_env(linker)?;
    register_wasi(linker)?;
    Ok(())
}

fn register_env(l: &mut Linker<VmState>) -> Result<()> {
    const ENV: &str = "env";

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

    // Buffers.
    l.func_wrap(
        ENV,
        "proxy_get_buffer_bytes",
        |mut c: C<'_>, t: i32, start: i32, max: i32, pp: i32, sp: i32| -> Result<i32> {
            count(&c, "proxy_get_buffer_bytes");
            fault(&c, "proxy_get_buffer_bytes")?;
            let Some(buf) = buffer_ref(&mut c, t) else {
                return Ok(st(Status::NotFound));
            };
            let start = (start as u32 as usize).min(buf.len());
            let end = start.saturating_add(max as u32 as usize).min(buf.len());
            give(&mut c, &buf[start..end], pp, sp)
        },
    )?;
    l.func_wrap(ENV, "proxy_get_buffer_status", |mut c: C<'_>, t: i32, lp: i32, fp: i32| -> Result<i32> {
        count(&c, "proxy_get_buffer_status");
        let Some(buf) = buffer_ref(&mut c, t) else {
            return Ok(st(Status::NotFound));
        };
        tri!(write_u32(&mut c, lp, buf.len() as u32));
        tri!(write_u32(&mut c, fp, 0));
        Ok(S_OK)
    })?;
    l.func_wrap(
        ENV,
        "proxy_set_buffer_bytes",
        |mut c: C<'_>, t: i32, start: i32, size: i32, p: i32, n: i32| -> Result<i32> {
            count(&c, "proxy_set_buffer_bytes");
            fault(&c, "proxy_set_buffer_bytes")?;
            let data = tri!(read(&mut c, p, n));
            let d = c.data_mut();
            let buf = match t {
                buffer_type::HTTP_CALL_RESPONSE_BODY => d.call_response.as_mut().map(|r| &mut r.1),
                buffer_type::REQUEST_BODY => d.stream().map(|s| &mut s.request_body),
                buffer_type::RESPONSE_BODY => d.stream().map(|s| &mut s.response_body),
                _ => None,
            };
            let Some(buf) = buf else {
                return Ok(st(Status::NotFound));
            };
            // Envoy's rules: at 0, drop `size` bytes and prepend (a prefix replaced); at or past
            // the end, append; anywhere else BadArgument (a filter cannot splice mid-body).
            let s = start as u32 as usize;
            if s > 0 && s < buf.len() {
                return Ok(st(Status::BadArgument));
            }
            let (s, e) = if s == 0 { (0, (size as u32 as usize).min(buf.len())) } else { (buf.len(), buf.len()) };
            buf.splice(s..e, data);
            Ok(S_OK)
        },
    )?;

    // Header maps.
    l.func_wrap(ENV, "proxy_get_header_map_pairs", |mut c: C<'_>, t: i32, pp: i32, sp: i32| -> Result<i32> {
        count(&c, "proxy_get_header_map_pairs");
        fault(&c, "proxy_get_header_map_pairs")?;
        match map_ref(&mut c, t) {
            Some(m) => give(&mut c, &abi::serialize_map(&m), pp, sp),
            None => give(&mut c, &[], pp, sp),
        }
    })?;
    l.func_wrap(ENV, "proxy_set_header_map_pairs", |mut c: C<'_>, t: i32, p: i32, n: i32| -> Result<i32> {
        count(&c, "proxy_set_header_map_pairs");
        let bytes = tri!(read(&mut c, p, n));
        let Some(new) = abi::deserialize_map(&bytes) else {
            return Ok(st(Status::SerializationFailure));
        };
        tri!(with_map(&mut c, t, |m| *m = new));
        Ok(S_OK)
    })?;
    l.func_wrap(
        ENV,
        "proxy_get_header_map_value",
        |mut c: C<'_>, t: i32, kp: i32, kn: i32, pp: i32, sp: i32| -> Result<i32> {
            count(&c, "proxy_get_header_map_value");
            fault(&c, "proxy_get_header_map_value")?;
            let key = tri!(read_str(&mut c, kp, kn));
            let Some(m) = map_ref(&mut c, t) else {
                return Ok(st(Status::NotFound));
            };
            match abi::header(&m, &key) {
                Some(v) => {
                    let v = v.to_vec();
                    give(&mut c, &v, pp, sp)
                }
                None => Ok(st(Status::NotFound)),
            }
        },
    )?;
    l.func_wrap(ENV, "proxy_remove_header_map_value", |mut c: C<'_>, t: i32, kp: i32, kn: i32| -> Result<i32> {
        count(&c, "proxy_remove_header_map_value");
        fault(&c, "proxy_remove_header_map_value")?;
        let key = tri!(read_str(&mut c, kp, kn)).to_ascii_lowercase();
        tri!(with_map(&mut c, t, |m| m.retain(|(k, _)| *k != key)));
        Ok(S_OK)
    })?;
    l.func_wrap(
        ENV,
        "proxy_replace_header_map_value",
        |mut c: C<'_>, t: i32, kp: i32, kn: i32, vp: i32, vn: i32| -> Result<i32> {
            count(&c, "proxy_replace_header_map_value");
            fault(&c, "proxy_replace_header_map_value")?;
            let key = tri!(read_str(&mut c, kp, kn)).to_ascii_lowercase();
            let val = tri!(read(&mut c, vp, vn));
            tri!(with_map(&mut c, t, |m| {
                // Envoy's setCopy: the first occurrence takes the value, later ones go away.
                if let Some(i) = m.iter().position(|(k, _)| *k == key) {
                    m[i].1 = val;
                    let mut seen = false;
                    m.retain(|(k, _)| {
                        if *k != key {
                            return true;
                        }
                        let keep = !seen;
                        seen = true;
                        keep
                    });
                } else {
                    m.push((key, val));
                }
            }));
            Ok(S_OK)
        },
    )?;
    l.func_wrap(
        ENV,
        "proxy_add_header_map_value",
        |mut c: C<'_>, t: i32, kp: i32, kn: i32, vp: i32, vn: i32| -> Result<i32> {
            count(&c, "proxy_add_header_map_value");
            fault(&c, "proxy_add_header_map_value")?;
            let key = tri!(read_str(&mut c, kp, kn)).to_ascii_lowercase();
            let val = tri!(read(&mut c, vp, vn));
            tri!(with_map(&mut c, t, |m| m.push((key, val))));
            Ok(S_OK)
        },
    )?;

    // Properties.
    l.func_wrap(ENV, "proxy_get_property", |mut c: C<'_>, p: i32, n: i32, pp: i32, sp: i32| -> Result<i32> {
        count(&c, "proxy_get_property");
        fault(&c, "proxy_get_property")?;
        let path = abi::property_path(&tri!(read(&mut c, p, n)));
        match property(&mut c, &path) {
            Some(v) => give(&mut c, &v, pp, sp),
            None => Ok(st(Status::NotFound)),
        }
    })?;
    l.func_wrap(ENV, "proxy_set_property", |mut c: C<'_>, p: i32, n: i32, vp: i32, vn: i32| -> Result<i32> {
        count(&c, "proxy_set_property");
        let path = abi::property_path(&tri!(read(&mut c, p, n)));
        let val = tri!(read(&mut c, vp, vn));
        let d = c.data_mut();
        match d.contexts.get_mut(&d.effective) {
            Some(Context::Http(s)) => {
                s.properties.insert(path, val);
            }
            Some(Context::Root { properties }) => {
                properties.insert(path, val);
            }
            None => return Ok(st(Status::NotFound)),
        }
        Ok(S_OK)
    })?;

    // Shared data: one map per process (one vm_id), one CAS counter.
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

    // Shared queues.
    l.func_wrap(ENV, "proxy_register_shared_queue", |mut c: C<'_>, np: i32, nn: i32, out: i32| -> Result<i32> {
        count(&c, "proxy_register_shared_queue");
        fault(&c, "proxy_register_shared_queue")?;
        let name = tri!(read_str(&mut c, np, nn));
        let (vm, root) = (c.data().vm, c.data().root_id);
        let id = {
            let mut p = c.data().proc.borrow_mut();
            let key = (p.vm_id.clone(), name.clone());
            match p.queue_names.get(&key).copied() {
                Some(id) => {
                    // Last registrant wins; pending items stay.
                    let q = p.queues.get_mut(&id).expect("queue index out of sync");
                    q.owner_vm = vm;
                    q.owner_context = root;
                    id
                }
                None => {
                    p.next_queue += 1;
                    let id = p.next_queue;
                    p.queues.insert(id, SharedQueue { owner_vm: vm, owner_context: root, items: Default::default() });
                    p.queue_names.insert(key, id);
                    id
                }
            }
        };
        tri!(write_u32(&mut c, out, id));
        Ok(S_OK)
    })?;
    l.func_wrap(
        ENV,
        "proxy_resolve_shared_queue",
        |mut c: C<'_>, vp: i32, vn: i32, np: i32, nn: i32, out: i32| -> Result<i32> {
            count(&c, "proxy_resolve_shared_queue");
            fault(&c, "proxy_resolve_shared_queue")?;
            let vm_id = tri!(read_str(&mut c, vp, vn));
            let name = tri!(read_str(&mut c, np, nn));
            let id = c.data().proc.borrow().queue_names.get(&(vm_id, name)).copied();
            let Some(id) = id else {
                return Ok(st(Status::NotFound));
            };
            tri!(write_u32(&mut c, out, id));
            Ok(S_OK)
        },
    )?;
    l.func_wrap(ENV, "proxy_dequeue_shared_queue", |mut c: C<'_>, id: i32, pp: i32, sp: i32| -> Result<i32> {
        count(&c, "proxy_dequeue_shared_queue");
        fault(&c, "proxy_dequeue_shared_queue")?;
        let item = {
            let mut p = c.data().proc.borrow_mut();
            let Some(q) = p.queues.get_mut(&(id as u32)) else {
                return Ok(st(Status::NotFound));
            };
            q.items.pop_front()
        };
        match item {
            Some(v) => give(&mut c, &v, pp, sp),
            None => Ok(st(Status::Empty)),
        }
    })?;
    l.func_wrap(ENV, "proxy_enqueue_shared_queue", |mut c: C<'_>, id: i32, vp: i32, vn: i32| -> Result<i32> {
        count(&c, "proxy_enqueue_shared_queue");
        fault(&c, "proxy_enqueue_shared_queue")?;
        let value = tri!(read(&mut c, vp, vn));
        let mut p = c.data().proc.borrow_mut();
        let Some(q) = p.queues.get_mut(&(id as u32)) else {
            return Ok(st(Status::NotFound));
        };
        q.items.push_back(value);
        let post = QueuePost { vm: q.owner_vm, context_id: q.owner_context, queue_id: id as u32 };
        p.posts.push(post);
        Ok(S_OK)
    })?;

    // Stream control: recorded now, applied by the engine after the VM call returns.
    fn defer(c: &mut C<'_>, a: StreamAction) -> i32 {
        let d = c.data_mut();
        let ctx = d.effective;
        if matches!(d.contexts.get(&ctx), Some(Context::Http(_))) {
            d.actions.push((ctx, a));
        } else {
            d.log(LogLevel::Warn, "host", format!("{a:?} ignored: context {ctx} is not an HTTP stream"));
        }
        S_OK
    }
    l.func_wrap(ENV, "proxy_continue_stream", |mut c: C<'_>, t: i32| -> Result<i32> {
        count(&c, "proxy_continue_stream");
        fault(&c, "proxy_continue_stream")?;
        Ok(match t {
            stream_type::REQUEST => defer(&mut c, StreamAction::ContinueRequest),
            stream_type::RESPONSE => defer(&mut c, StreamAction::ContinueResponse),
            stream_type::DOWNSTREAM | stream_type::UPSTREAM => st(Status::Unimplemented),
            _ => st(Status::BadArgument),
        })
    })?;
    l.func_wrap(ENV, "proxy_continue_request", |mut c: C<'_>| -> Result<i32> {
        count(&c, "proxy_continue_request");
        fault(&c, "proxy_continue_request")?;
        Ok(defer(&mut c, StreamAction::ContinueRequest))
    })?;
    l.func_wrap(ENV, "proxy_continue_response", |mut c: C<'_>| -> Result<i32> {
        count(&c, "proxy_continue_response");
        fault(&c, "proxy_continue_response")?;
        Ok(defer(&mut c, StreamAction::ContinueResponse))
    })?;
    l.func_wrap(ENV, "proxy_close_stream", |mut c: C<'_>, t: i32| -> Result<i32> {
        count(&c, "proxy_close_stream");
        Ok(match t {
            stream_type::REQUEST | stream_type::RESPONSE => defer(&mut c, StreamAction::Reset),
            stream_type::DOWNSTREAM | stream_type::UPSTREAM => st(Status::Unimplemented),
            _ => st(Status::BadArgument),
        })
    })?;
    l.func_wrap(
        ENV,
        "proxy_send_local_response",
        |mut c: C<'_>, status: i32, dp: i32, dn: i32, bp: i32, bn: i32, hp: i32, hn: i32, _grpc: i32| -> Result<i32> {
            count(&c, "proxy_send_local_response");
            fault(&c, "proxy_send_local_response")?;
            let details = tri!(read_str(&mut c, dp, dn));
            let body = tri!(read(&mut c, bp, bn));
            let hb = tri!(read(&mut c, hp, hn));
            let Some(headers) = abi::deserialize_map(&hb) else {
                return Ok(st(Status::SerializationFailure));
            };
            Ok(defer(&mut c, StreamAction::LocalReply { status: status as u16, details, headers, body }))
        },
    )?;
    l.func_wrap(ENV, "proxy_clear_route_cache", |c: C<'_>| -> Result<i32> {
        count(&c, "proxy_clear_route_cache");
        Ok(S_OK)
    })?;

    // HTTP call-outs.
    l.func_wrap(
        ENV,
        "proxy_http_call",
        |mut c: C<'_>,
         up: i32,
         un: i32,
         hp: i32,
         hn: i32,
         bp: i32,
         bn: i32,
         tp: i32,
         tn: i32,
         timeout: i32,
         out: i32|
         -> Result<i32> {
            count(&c, "proxy_http_call");
            fault(&c, "proxy_http_call")?;
            let cluster = tri!(read_str(&mut c, up, un));
            let Some(headers) = abi::deserialize_map(&tri!(read(&mut c, hp, hn))) else {
                return Ok(st(Status::SerializationFailure));
            };
            let body = tri!(read(&mut c, bp, bn));
            if abi::deserialize_map(&tri!(read(&mut c, tp, tn))).is_none() {
                return Ok(st(Status::SerializationFailure));
            }
            // Envoy rejects a call without these pseudo-headers.
            for h in [":method", ":path", ":authority"] {
                if abi::header(&headers, h).is_none() {
                    c.data().log(LogLevel::Warn, "host", format!("proxy_http_call: missing {h}"));
                    return Ok(st(Status::BadArgument));
                }
            }
            let (vm, ctx, instance) = (c.data().vm, c.data().effective, c.data().instance);
            let token = {
                let mut p = c.data().proc.borrow_mut();
                let endpoint = match p.clusters.get_mut(&cluster) {
                    None => {
                        drop(p);
                        c.data().log(LogLevel::Warn, "host", format!("proxy_http_call: unknown cluster {cluster}"));
                        return Ok(st(Status::BadArgument));
                    }
                    Some((Cluster::Static(eps), rr)) => {
                        let ep = (!eps.is_empty()).then(|| eps[*rr % eps.len()].clone());
                        *rr += 1;
                        ep
                    }
                    Some((Cluster::OriginalDst { header }, _)) => abi::header_str(&headers, header).map(str::to_string),
                };
                p.next_token += 1;
                let token = p.next_token;
                p.http_calls.push(HttpCallOut {
                    vm,
                    instance,
                    context_id: ctx,
                    token,
                    cluster,
                    endpoint,
                    headers,
                    body,
                    timeout_ms: timeout as u32,
                });
                token
            };
            tri!(write_u32(&mut c, out, token));
            Ok(S_OK)
        },
    )?;

    // gRPC is not simulated: the ABI's Unimplemented status instead of a trap.
    l.func_wrap(
        ENV,
        "proxy_grpc_call",
        |c: C<'_>,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32|
         -> Result<i32> {
            count(&c, "proxy_grpc_call");
            Ok(st(Status::Unimplemented))
        },
    )?;
    l.func_wrap(
        ENV,
        "proxy_grpc_stream",
        |c: C<'_>, _: i32, _: i32, _: i32, _: i32, _: i32, _: i32, _: i32, _: i32, _: i32| -> Result<i32> {
            count(&c, "proxy_grpc_stream");
            Ok(st(Status::Unimplemented))
        },
    )?;
    l.func_wrap(ENV, "proxy_grpc_send", |c: C<'_>, _: i32, _: i32, _: i32, _: i32| -> Result<i32> {
        count(&c, "proxy_grpc_send");
        Ok(st(Status::Unimplemented))
    })?;
    l.func_wrap(ENV, "proxy_grpc_cancel", |c: C<'_>, _: i32| -> Result<i32> {
        count(&c, "proxy_grpc_cancel");
        Ok(st(Status::Unimplemented))
    })?;
    l.func_wrap(ENV, "proxy_grpc_close", |c: C<'_>, _: i32| -> Result<i32> {
        count(&c, "proxy_grpc_close");
        Ok(st(Status::Unimplemented))
    })?;
    l.func_wrap(ENV, "proxy_get_status", |c: C<'_>, _: i32, _: i32, _: i32| -> Result<i32> {
        count(&c, "proxy_get_status");
        Ok(st(Status::Unimplemented))
    })?;

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
    l.func_wrap(ENV, "proxy_get_configuration", |mut c: C<'_>, pp: i32, sp: i32| -> Result<i32> {
        count(&c, "proxy_get_configuration");
        let cfg = c.data().plugin_configuration.clone();
        give(&mut c, &cfg, pp, sp)
    })?;

    // Metrics: ids are per definition, values per name (Envoy's stat scope is process-wide).
    l.func_wrap(ENV, "proxy_define_metric", |mut c: C<'_>, t: i32, np: i32, nn: i32, out: i32| -> Result<i32> {
        count(&c, "proxy_define_metric");
        let name = tri!(read_str(&mut c, np, nn));
        let kind = match t {
            metric_type::COUNTER => "counter",
            metric_type::GAUGE => "gauge",
            metric_type::HISTOGRAM => "histogram",
            _ => return Ok(st(Status::BadArgument)),
        };
        let id = {
            let mut p = c.data().proc.borrow_mut();
            let idx = match p.metrics.iter().position(|m| m.name == name) {
                Some(i) if p.metrics[i].kind != kind => return Ok(st(Status::BadArgument)),
                Some(i) => i,
                None => {
                    p.metrics.push(Metric { name, kind, value: 0, samples: Vec::new() });
                    p.metrics.len() - 1
                }
            };
            p.next_metric += 1;
            let id = p.next_metric;
            p.metric_ids.insert(id, idx);
            id
        };
        tri!(write_u32(&mut c, out, id));
        Ok(S_OK)
    })?;
    l.func_wrap(ENV, "proxy_increment_metric", |c: C<'_>, id: i32, off: i64| -> Result<i32> {
        count(&c, "proxy_increment_metric");
        fault(&c, "proxy_increment_metric")?;
        let mut p = c.data().proc.borrow_mut();
        let Some(&i) = p.metric_ids.get(&(id as u32)) else {
            return Ok(st(Status::NotFound));
        };
        let m = &mut p.metrics[i];
        match m.kind {
            "counter" if off > 0 => m.value = m.value.wrapping_add(off as u64),
            "gauge" if off >= 0 => m.value = m.value.wrapping_add(off as u64),
            "gauge" => m.value = m.value.saturating_sub(off.unsigned_abs()),
            _ => return Ok(st(Status::BadArgument)),
        }
        Ok(S_OK)
    })?;
    l.func_wrap(ENV, "proxy_record_metric", |c: C<'_>, id: i32, v: i64| -> Result<i32> {
        count(&c, "proxy_record_metric");
        fault(&c, "proxy_record_metric")?;
        let mut p = c.data().proc.borrow_mut();
        let Some(&i) = p.metric_ids.get(&(id as u32)) else {
            return Ok(st(Status::NotFound));
        };
        let m = &mut p.metrics[i];
        match m.kind {
            "counter" => m.value = m.value.wrapping_add(v as u64),
            "gauge" => m.value = v as u64,
            _ => {
                m.value += 1;
                m.samples.push(v as u64);
            }
        }
        Ok(S_OK)
    })?;
    l.func_wrap(ENV, "proxy_get_metric", |mut c: C<'_>, id: i32, out: i32| -> Result<i32> {
        count(&c, "proxy_get_metric");
        let v = {
            let p = c.data().proc.borrow();
            let Some(&i) = p.metric_ids.get(&(id as u32)) else {
                return Ok(st(Status::NotFound));
            };
            let m = &p.metrics[i];
            if m.kind == "histogram" {
                return Ok(st(Status::BadArgument));
            }
            m.value
        };
        tri!(write_u64(&mut c, out, v));
        Ok(S_OK)
    })?;
    Ok(())
}

/// WASI errno values used below.
mod errno {
    pub const SUCCESS: i32 = 0;
    pub const BADF: i32 = 8;
    pub const FAULT: i32 = 21;
    pub const INVAL: i32 = 28;
    pub const NOSYS: i32 = 52;
    pub const SPIPE: i32 = 70;
}

fn register_wasi(l: &mut Linker<VmState>) -> Result<()> {
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
