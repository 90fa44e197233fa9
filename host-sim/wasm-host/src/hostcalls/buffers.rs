//! Buffers: the request and response bodies a callback sees, the http-call response body, and the
//! VM and plugin configurations.

use super::{count, fault, give, read, st, write_u32, C, ENV, S_OK};
use crate::abi::{buffer_type, Status};
use crate::state::VmState;
use wasmtime::{Linker, Result};

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

/// Adds this group's host functions to `linker`.
pub fn add_to_linker(l: &mut Linker<VmState>) -> Result<()> {
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

    l.func_wrap(ENV, "proxy_get_configuration", |mut c: C<'_>, pp: i32, sp: i32| -> Result<i32> {
        count(&c, "proxy_get_configuration");
        let cfg = c.data().plugin_configuration.clone();
        give(&mut c, &cfg, pp, sp)
    })?;
    Ok(())
}
