//! Stream control: continue, close and local replies are recorded now and applied by the embedder
//! after the VM call returns.

use super::{count, fault, read, read_str, st, C, ENV, S_OK};
use crate::abi::{self, stream_type, LogLevel, Status};
use crate::state::{Context, StreamAction, VmState};
use wasmtime::{Linker, Result};

/// Records a stream action for the effective context, which must be an HTTP stream.
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

/// Adds this group's host functions to `linker`.
pub fn add_to_linker(l: &mut Linker<VmState>) -> Result<()> {
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
    Ok(())
}
