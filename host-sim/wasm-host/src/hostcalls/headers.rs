//! Header maps: request and response headers and trailers of the effective stream, and those of the
//! http-call response being delivered.

use super::{count, fault, give, read, read_str, st, C, ENV, S_OK};
use crate::abi::{self, map_type, HeaderMap, Status};
use crate::state::VmState;
use wasmtime::{Linker, Result};

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

/// Adds this group's host functions to `linker`.
pub fn add_to_linker(l: &mut Linker<VmState>) -> Result<()> {
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

    Ok(())
}
