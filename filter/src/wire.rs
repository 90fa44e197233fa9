//! Messages between worker VMs and the scheduler VM, carried by proxy-wasm
//! shared queues. A compact little-endian encoding: one tag byte, fixed
//! fields, then the tenant name as the remaining bytes.

/// A worker tells the scheduler.
#[derive(Clone, Debug, PartialEq)]
pub enum ToScheduler {
    /// Queue this request (the worker holds its paused stream).
    Enqueue { worker: u32, req: u64, input_tokens: u32, max_tokens: u32, arrival_ms: u64, tenant: String },
    /// The client went away while the request was queued.
    Cancel { req: u64 },
    /// Service for `tenant`: a request that bypassed the queue was sent with
    /// `input_tokens`, or `output_tokens` more were generated; `done` means a
    /// dispatched request finished and released its stock.
    Charge { input_tokens: u32, output_tokens: u32, done: bool, tenant: String },
}

/// The scheduler tells a worker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToWorker {
    /// Resume the request towards `endpoint` (an index into the configured endpoints).
    Dispatch { req: u64, endpoint: u32 },
    /// Answer the request with an error.
    Reject { req: u64, reason: u8 },
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take<const N: usize>(&mut self) -> Option<[u8; N]> {
        let (head, rest) = self.0.split_first_chunk::<N>()?;
        self.0 = rest;
        Some(*head)
    }
    fn u8(&mut self) -> Option<u8> {
        self.take::<1>().map(|b| b[0])
    }
    fn u32(&mut self) -> Option<u32> {
        self.take().map(u32::from_le_bytes)
    }
    fn u64(&mut self) -> Option<u64> {
        self.take().map(u64::from_le_bytes)
    }
    fn rest_str(self) -> Option<String> {
        String::from_utf8(self.0.to_vec()).ok()
    }
}

impl ToScheduler {
    /// Encodes for `enqueue_shared_queue`.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(48);
        match self {
            ToScheduler::Enqueue { worker, req, input_tokens, max_tokens, arrival_ms, tenant } => {
                b.push(1);
                b.extend_from_slice(&worker.to_le_bytes());
                b.extend_from_slice(&req.to_le_bytes());
                b.extend_from_slice(&input_tokens.to_le_bytes());
                b.extend_from_slice(&max_tokens.to_le_bytes());
                b.extend_from_slice(&arrival_ms.to_le_bytes());
                b.extend_from_slice(tenant.as_bytes());
            }
            ToScheduler::Cancel { req } => {
                b.push(2);
                b.extend_from_slice(&req.to_le_bytes());
            }
            ToScheduler::Charge { input_tokens, output_tokens, done, tenant } => {
                b.push(3);
                b.extend_from_slice(&input_tokens.to_le_bytes());
                b.extend_from_slice(&output_tokens.to_le_bytes());
                b.push(*done as u8);
                b.extend_from_slice(tenant.as_bytes());
            }
        }
        b
    }

    /// Decodes; `None` for bytes no sluice worker wrote.
    pub fn decode(bytes: &[u8]) -> Option<ToScheduler> {
        let mut r = Reader(bytes);
        match r.u8()? {
            1 => Some(ToScheduler::Enqueue {
                worker: r.u32()?,
                req: r.u64()?,
                input_tokens: r.u32()?,
                max_tokens: r.u32()?,
                arrival_ms: r.u64()?,
                tenant: r.rest_str()?,
            }),
            2 => {
                let req = r.u64()?;
                r.0.is_empty().then_some(ToScheduler::Cancel { req })
            }
            3 => Some(ToScheduler::Charge {
                input_tokens: r.u32()?,
                output_tokens: r.u32()?,
                done: r.u8()? != 0,
                tenant: r.rest_str()?,
            }),
            _ => None,
        }
    }
}

impl ToWorker {
    /// Encodes for `enqueue_shared_queue`.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(13);
        match self {
            ToWorker::Dispatch { req, endpoint } => {
                b.push(1);
                b.extend_from_slice(&req.to_le_bytes());
                b.extend_from_slice(&endpoint.to_le_bytes());
            }
            ToWorker::Reject { req, reason } => {
                b.push(2);
                b.extend_from_slice(&req.to_le_bytes());
                b.push(*reason);
            }
        }
        b
    }

    /// Decodes; `None` for bytes no sluice scheduler wrote.
    pub fn decode(bytes: &[u8]) -> Option<ToWorker> {
        let mut r = Reader(bytes);
        let m = match r.u8()? {
            1 => ToWorker::Dispatch { req: r.u64()?, endpoint: r.u32()? },
            2 => ToWorker::Reject { req: r.u64()?, reason: r.u8()? },
            _ => return None,
        };
        r.0.is_empty().then_some(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip() {
        let to_sched = [
            ToScheduler::Enqueue {
                worker: 3,
                req: u64::MAX - 1,
                input_tokens: 17,
                max_tokens: 256,
                arrival_ms: 1_700_000_000_123,
                tenant: "tenant-ä".into(),
            },
            ToScheduler::Cancel { req: 42 },
            ToScheduler::Charge { input_tokens: 7, output_tokens: 5, done: true, tenant: String::new() },
        ];
        for m in to_sched {
            assert_eq!(ToScheduler::decode(&m.encode()), Some(m));
        }
        for m in [ToWorker::Dispatch { req: 9, endpoint: 2 }, ToWorker::Reject { req: 1, reason: 3 }] {
            assert_eq!(ToWorker::decode(&m.encode()), Some(m));
        }
    }

    #[test]
    fn garbage_is_refused_not_misread() {
        assert_eq!(ToScheduler::decode(&[]), None);
        assert_eq!(ToScheduler::decode(&[9, 1, 2]), None);
        assert_eq!(ToScheduler::decode(&[1, 0, 0]), None);
        assert_eq!(ToWorker::decode(&[1, 0]), None);
        assert_eq!(ToWorker::decode(&ToWorker::Reject { req: 1, reason: 0 }.encode()[..5]), None);
        let mut long = ToWorker::Dispatch { req: 1, endpoint: 0 }.encode();
        long.push(0);
        assert_eq!(ToWorker::decode(&long), None);
    }
}
