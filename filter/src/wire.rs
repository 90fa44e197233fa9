//! Messages between worker VMs and the scheduler VM, carried by proxy-wasm
//! shared queues. A compact little-endian encoding: one tag byte, fixed
//! fields, then the tenant name as the remaining bytes. Tags: 1 `Enqueue`,
//! 2 `Cancel`, 3 `Charge`, 4 a batch of messages, 5 `Wake`.

use crate::outcome::Outcome;
use sluice_policies::bands::Criticality;

/// The worker that holds a request: request ids are `worker << 32 | context id`.
pub fn worker_of(req: u64) -> u32 {
    (req >> 32) as u32
}

/// A band's code on the wire and in saved counters: its index in
/// [`Criticality::ALL`] (highest first).
pub fn band_code(b: Criticality) -> u8 {
    Criticality::ALL.iter().position(|&x| x == b).expect("a band") as u8
}

/// Band from its code (unknown codes are the default band).
pub fn band_of_code(code: u8) -> Criticality {
    Criticality::ALL.get(code as usize).copied().unwrap_or(Criticality::Standard)
}

/// What routing needs of a request, owned so it can wait in the queue.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RouteInfo {
    /// Hash of the session header, if any.
    pub session: Option<u64>,
    /// The requested model.
    pub model: String,
    /// Chained prefix-block hashes of the prompt.
    pub prefix: Vec<u64>,
}

impl RouteInfo {
    /// The borrowed form the router takes.
    pub fn as_request(&self) -> sluice_policies::routing::RouteRequest<'_> {
        sluice_policies::routing::RouteRequest { prefix: &self.prefix, session: self.session, model: &self.model }
    }
}

/// A request's objective, as the scheduler needs it: the absolute deadline
/// of its first token and the objective it came from (so that the time
/// already spent, upstream included, is `now − (at_ms − ttft_ms)`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Deadline {
    /// When the first token is due, on the proxy's clock.
    pub at_ms: u64,
    /// The TTFT objective, in milliseconds.
    pub ttft_ms: u32,
}

/// A worker tells the scheduler.
#[derive(Clone, Debug, PartialEq)]
pub enum ToScheduler {
    /// Queue this request (the worker that holds its paused stream is
    /// `req >> 32`). `band` is a criticality code; `max_tokens` 0 is "not given".
    Enqueue {
        req: u64,
        band: u8,
        input_tokens: u32,
        max_tokens: u32,
        arrival_ms: u64,
        deadline: Option<Deadline>,
        route: RouteInfo,
        tenant: String,
    },
    /// The client went away while the request was queued, or before the
    /// scheduler's dispatch reached its stream (the scheduler then closes
    /// that dispatch; later `Cancel`s for the same request change nothing).
    Cancel { req: u64 },
    /// Service of request `req` of `tenant` in `band`: it bypassed the queue
    /// with `input_tokens`, or `output_tokens` more were generated; `done`
    /// means it finished and released its stock. A charge with an empty
    /// tenant reaches only a request the scheduler knows to be running.
    /// `first_token_ms`:
    /// the first output came this long after the request was sent upstream
    /// (given once). `model` is given with a bypass charge.
    Charge {
        req: u64,
        band: u8,
        input_tokens: u32,
        max_tokens: u32,
        output_tokens: u32,
        done: bool,
        first_token_ms: Option<u32>,
        model: String,
        tenant: String,
    },
    /// Stock was freed outside any request's accounting (a dispatch that
    /// found its stream already running gave its slot back): dispatch again.
    Wake,
}

/// The scheduler tells a worker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToWorker {
    /// Resume the request towards `endpoint` (an index into the configured
    /// endpoints); `predicted_ttft_ms` is the estimator's prediction made when
    /// it was queued, when there was one and the configuration exposes it.
    Dispatch { req: u64, endpoint: u32, predicted_ttft_ms: Option<u32> },
    /// Answer the request with this outcome.
    Reject { req: u64, outcome: Outcome },
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
    fn u16(&mut self) -> Option<u16> {
        self.take().map(u16::from_le_bytes)
    }
    fn bytes(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }
    fn route(&mut self) -> Option<RouteInfo> {
        let session = match self.u8()? {
            0 => None,
            1 => Some(self.u64()?),
            _ => return None,
        };
        let n = self.u16()? as usize;
        let model = String::from_utf8(self.bytes(n)?.to_vec()).ok()?;
        let n = self.u16()? as usize;
        let prefix = (0..n).map(|_| self.u64()).collect::<Option<Vec<u64>>>()?;
        Some(RouteInfo { session, model, prefix })
    }
    fn opt_u32(&mut self) -> Option<Option<u32>> {
        match self.u8()? {
            0 => Some(None),
            1 => Some(Some(self.u32()?)),
            _ => None,
        }
    }
    fn str16(&mut self) -> Option<String> {
        let n = self.u16()? as usize;
        String::from_utf8(self.bytes(n)?.to_vec()).ok()
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
            ToScheduler::Enqueue { req, band, input_tokens, max_tokens, arrival_ms, deadline, route, tenant } => {
                b.push(1);
                b.extend_from_slice(&req.to_le_bytes());
                b.push(*band);
                b.extend_from_slice(&input_tokens.to_le_bytes());
                b.extend_from_slice(&max_tokens.to_le_bytes());
                b.extend_from_slice(&arrival_ms.to_le_bytes());
                match deadline {
                    None => b.push(0),
                    Some(d) => {
                        b.push(1);
                        b.extend_from_slice(&d.at_ms.to_le_bytes());
                        b.extend_from_slice(&d.ttft_ms.to_le_bytes());
                    }
                }
                match route.session {
                    None => b.push(0),
                    Some(h) => {
                        b.push(1);
                        b.extend_from_slice(&h.to_le_bytes());
                    }
                }
                // Lengths are u16 on the wire: longer model names or prefixes are cut.
                put_str16(&mut b, &route.model);
                let prefix = &route.prefix[..route.prefix.len().min(u16::MAX as usize)];
                b.extend_from_slice(&(prefix.len() as u16).to_le_bytes());
                prefix.iter().for_each(|h| b.extend_from_slice(&h.to_le_bytes()));
                b.extend_from_slice(tenant.as_bytes());
            }
            ToScheduler::Cancel { req } => {
                b.push(2);
                b.extend_from_slice(&req.to_le_bytes());
            }
            ToScheduler::Charge {
                req,
                band,
                input_tokens,
                max_tokens,
                output_tokens,
                done,
                first_token_ms,
                model,
                tenant,
            } => {
                b.push(3);
                b.extend_from_slice(&req.to_le_bytes());
                b.push(*band);
                b.extend_from_slice(&input_tokens.to_le_bytes());
                b.extend_from_slice(&max_tokens.to_le_bytes());
                b.extend_from_slice(&output_tokens.to_le_bytes());
                b.push(*done as u8);
                put_opt_u32(&mut b, *first_token_ms);
                put_str16(&mut b, model);
                b.extend_from_slice(tenant.as_bytes());
            }
            ToScheduler::Wake => b.push(5),
        }
        b
    }

    /// Decodes; `None` for bytes no sluice worker wrote.
    pub fn decode(bytes: &[u8]) -> Option<ToScheduler> {
        let mut r = Reader(bytes);
        match r.u8()? {
            1 => Some(ToScheduler::Enqueue {
                req: r.u64()?,
                band: r.u8()?,
                input_tokens: r.u32()?,
                max_tokens: r.u32()?,
                arrival_ms: r.u64()?,
                deadline: match r.u8()? {
                    0 => None,
                    1 => Some(Deadline { at_ms: r.u64()?, ttft_ms: r.u32()? }),
                    _ => return None,
                },
                route: r.route()?,
                tenant: r.rest_str()?,
            }),
            2 => {
                let req = r.u64()?;
                r.0.is_empty().then_some(ToScheduler::Cancel { req })
            }
            3 => Some(ToScheduler::Charge {
                req: r.u64()?,
                band: r.u8()?,
                input_tokens: r.u32()?,
                max_tokens: r.u32()?,
                output_tokens: r.u32()?,
                done: r.u8()? != 0,
                first_token_ms: r.opt_u32()?,
                model: r.str16()?,
                tenant: r.rest_str()?,
            }),
            5 => r.0.is_empty().then_some(ToScheduler::Wake),
            _ => None,
        }
    }
}

/// Writes `s` as a u16 length and its bytes, cut at a character boundary
/// under 64 KiB.
fn put_str16(b: &mut Vec<u8>, s: &str) {
    let mut n = s.len().min(u16::MAX as usize);
    while !s.is_char_boundary(n) {
        n -= 1;
    }
    b.extend_from_slice(&(n as u16).to_le_bytes());
    b.extend_from_slice(&s.as_bytes()[..n]);
}

fn put_opt_u32(b: &mut Vec<u8>, v: Option<u32>) {
    match v {
        None => b.push(0),
        Some(v) => {
            b.push(1);
            b.extend_from_slice(&v.to_le_bytes());
        }
    }
}

/// Several messages in one queue entry (one wake-up of the scheduler):
/// tag 4, then each message as a u32 length and its bytes.
pub fn encode_batch<'a>(msgs: impl IntoIterator<Item = &'a ToScheduler>) -> Vec<u8> {
    let mut b = vec![4];
    for m in msgs {
        let one = m.encode();
        b.extend_from_slice(&(one.len() as u32).to_le_bytes());
        b.extend_from_slice(&one);
    }
    b
}

/// Decodes one queue entry: a batch or a single message; `None` if any part
/// is malformed (nothing of a damaged entry is applied).
pub fn decode_entry(bytes: &[u8]) -> Option<Vec<ToScheduler>> {
    let Some((&4, mut rest)) = bytes.split_first() else {
        return ToScheduler::decode(bytes).map(|m| vec![m]);
    };
    let mut out = Vec::new();
    while !rest.is_empty() {
        let (len, tail) = rest.split_first_chunk::<4>()?;
        let len = u32::from_le_bytes(*len) as usize;
        if tail.len() < len {
            return None;
        }
        out.push(ToScheduler::decode(&tail[..len])?);
        rest = &tail[len..];
    }
    Some(out)
}

impl ToWorker {
    /// Encodes for `enqueue_shared_queue`.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(13);
        match self {
            ToWorker::Dispatch { req, endpoint, predicted_ttft_ms } => {
                b.push(1);
                b.extend_from_slice(&req.to_le_bytes());
                b.extend_from_slice(&endpoint.to_le_bytes());
                put_opt_u32(&mut b, *predicted_ttft_ms);
            }
            ToWorker::Reject { req, outcome } => {
                b.push(2);
                b.extend_from_slice(&req.to_le_bytes());
                b.push(outcome.code());
            }
        }
        b
    }

    /// Decodes; `None` for bytes no sluice scheduler wrote.
    pub fn decode(bytes: &[u8]) -> Option<ToWorker> {
        let mut r = Reader(bytes);
        let m = match r.u8()? {
            1 => ToWorker::Dispatch { req: r.u64()?, endpoint: r.u32()?, predicted_ttft_ms: r.opt_u32()? },
            2 => ToWorker::Reject { req: r.u64()?, outcome: Outcome::from_code(r.u8()?)? },
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
                req: u64::MAX - 1,
                band: 2,
                input_tokens: 17,
                max_tokens: 256,
                arrival_ms: 1_700_000_000_123,
                deadline: Some(Deadline { at_ms: 1_700_000_020_123, ttft_ms: 20_000 }),
                route: RouteInfo { session: Some(0), model: "llama-ä".into(), prefix: vec![1, u64::MAX] },
                tenant: "tenant-ä".into(),
            },
            ToScheduler::Enqueue {
                req: 0,
                band: 0,
                input_tokens: 0,
                max_tokens: 0,
                arrival_ms: 0,
                deadline: None,
                route: RouteInfo::default(),
                tenant: String::new(),
            },
            ToScheduler::Cancel { req: 42 },
            ToScheduler::Wake,
            ToScheduler::Charge {
                req: 3 << 32 | 9,
                band: 1,
                input_tokens: 7,
                max_tokens: 30,
                output_tokens: 5,
                done: true,
                first_token_ms: Some(120),
                model: "m".into(),
                tenant: "t".into(),
            },
        ];
        for m in to_sched {
            assert_eq!(ToScheduler::decode(&m.encode()), Some(m));
        }
        for m in [
            ToWorker::Dispatch { req: 9, endpoint: 2, predicted_ttft_ms: None },
            ToWorker::Dispatch { req: 9, endpoint: 2, predicted_ttft_ms: Some(1234) },
            ToWorker::Reject { req: 1, outcome: Outcome::SloUnattainable },
        ] {
            assert_eq!(ToWorker::decode(&m.encode()), Some(m));
        }
    }

    #[test]
    fn request_ids_name_their_worker_and_band_codes_round_trip() {
        assert_eq!(worker_of(3 << 32 | 9), 3);
        for (code, band) in Criticality::ALL.into_iter().enumerate() {
            assert_eq!(band_code(band), code as u8);
            assert_eq!(band_of_code(code as u8), band);
        }
        assert_eq!(band_of_code(200), Criticality::Standard, "an unknown code is the default band");
    }

    #[test]
    fn batches_round_trip_and_damage_spoils_the_whole_entry() {
        let msgs = vec![
            ToScheduler::Cancel { req: 1 },
            ToScheduler::Charge {
                req: 2,
                band: 0,
                input_tokens: 3,
                max_tokens: 4,
                output_tokens: 5,
                done: false,
                first_token_ms: None,
                model: String::new(),
                tenant: "a".into(),
            },
        ];
        let b = encode_batch(&msgs);
        assert_eq!(decode_entry(&b), Some(msgs.clone()));
        assert_eq!(decode_entry(&encode_batch(&[])), Some(vec![]));
        assert_eq!(decode_entry(&msgs[0].encode()), Some(vec![msgs[0].clone()]), "a single message is an entry too");
        assert_eq!(decode_entry(&b[..b.len() - 1]), None);
        let mut bad = b.clone();
        bad[5] = 9; // the first message's tag
        assert_eq!(decode_entry(&bad), None);
    }

    #[test]
    fn garbage_is_refused_not_misread() {
        assert_eq!(ToScheduler::decode(&[]), None);
        assert_eq!(ToScheduler::decode(&[9, 1, 2]), None);
        assert_eq!(ToScheduler::decode(&[1, 0, 0]), None);
        assert_eq!(ToScheduler::decode(&[5, 0]), None, "a wake-up carries nothing");
        assert_eq!(ToWorker::decode(&[1, 0]), None);
        assert_eq!(ToWorker::decode(&ToWorker::Reject { req: 1, outcome: Outcome::QueueFull }.encode()[..5]), None);
        let mut long = ToWorker::Dispatch { req: 1, endpoint: 0, predicted_ttft_ms: None }.encode();
        long.push(0);
        assert_eq!(ToWorker::decode(&long), None);
    }
}
