//! Metrics: ids are per definition, values per name (Envoy's stat scope is process-wide).

use super::{count, fault, read_str, st, write_u32, write_u64, C, ENV, S_OK};
use crate::abi::{metric_type, Status};
use crate::state::{Metric, VmState};
use wasmtime::{Linker, Result};

/// Adds this group's host functions to `linker`.
pub fn add_to_linker(l: &mut Linker<VmState>) -> Result<()> {
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
