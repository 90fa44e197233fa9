//! Properties: per-context values (set by the embedder or by `proxy_set_property`, Envoy's filter
//! state), those Envoy derives from the request, then the process-wide ones and the plugin's names.

use super::{count, fault, give, read, st, C, ENV, S_OK};
use crate::abi::{self, Status};
use crate::state::{Context, VmState};
use wasmtime::{Linker, Result};

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

/// Adds this group's host functions to `linker`.
pub fn add_to_linker(l: &mut Linker<VmState>) -> Result<()> {
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

    Ok(())
}
