//! Call-outs: `proxy_http_call` validated and recorded for the embedder to route; gRPC is not
//! implemented and answers the ABI's Unimplemented status instead of trapping.

use super::{count, fault, read, read_str, st, write_u32, C, ENV, S_OK};
use crate::abi::{self, LogLevel, Status};
use crate::state::{Cluster, HttpCallOut, VmState};
use wasmtime::{Linker, Result};

/// Adds this group's host functions to `linker`.
pub fn add_to_linker(l: &mut Linker<VmState>) -> Result<()> {
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

    Ok(())
}
