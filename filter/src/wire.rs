//! Messages between worker VMs and the scheduler VM, carried by proxy-wasm
//! shared queues. A compact little-endian encoding: one tag byte, fixed
//! fields, then the tenant name as the remaining bytes. Tags: 1 `Enqueue`,
//! 2 `Cancel`, 3 `Charge`, 4 a batch of messages, 5 `Wake`. Also the wire's
//! vocabulary: request ids ([`RequestId`]) and band codes ([`band_code`]).

use crate::outcome::Outcome;
use sluice_policies::bands::Criticality;

/// A request's id in the protocol: the worker that holds its stream in the
/// high 32 bits, the stream's context id in the low 32.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

impl RequestId {
    /// Stream `ctx` of worker `worker`.
    pub fn new(worker: u32, ctx: u32) -> RequestId {
        RequestId((worker as u64) << 32 | ctx as u64)
    }

    /// The worker that holds its stream.
    pub fn worker(self) -> u32 {
        worker_of(self.0)
    }

    /// Its stream's context id in that worker.
    pub fn ctx(self) -> u32 {
        self.0 as u32
    }
}

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
    /// `req >> 32`). `max_tokens` 0 is "not given".
    Enqueue {
        req: RequestId,
        band: Criticality,
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
    Cancel { req: RequestId },
    /// What happened to a request that runs since it last reported: see [`Charge`].
    Charge(Charge),
    /// Stock was freed outside any request's accounting (a dispatch that
    /// found its stream already running gave its slot back): dispatch again.
    Wake,
}

/// A running request's report to the scheduler: its events since its last
/// report, each in a field of its own, applied in this order: it was
/// dispatched (bypassed the queue), produced output, ended. A worker folds
/// the events of one request into one report while they wait for the tick.
#[derive(Clone, Debug, PartialEq)]
pub struct Charge {
    pub req: RequestId,
    /// Its band.
    pub band: Criticality,
    /// Its tenant (a report for a request the scheduler does not know to
    /// run is charged to it; empty: to nobody).
    pub tenant: String,
    /// It bypassed the queue and was sent upstream (told once, first).
    pub dispatched: Option<Dispatched>,
    /// Output generated since its last report.
    pub output: Output,
    /// It ended and gave its stock back (told once, last).
    pub done: Option<Done>,
}

/// A running request's end, as its response told it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Done {
    /// The prompt's tokens as the engine counted them (`usage.prompt_tokens`),
    /// when it said: the dispatch-time estimate is corrected to it.
    pub prompt_tokens: Option<u32>,
    /// Of those, the ones the engine served from its prefix cache, when it
    /// said: priced at the policy's `cached_input_weight` in the same correction.
    pub cached_tokens: Option<u32>,
}

/// A bypass: a request sent upstream without joining the queue.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Dispatched {
    pub input_tokens: u32,
    /// The client's bound on output (0: not given).
    pub max_tokens: u32,
    pub model: String,
}

/// Output of a running request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Output {
    /// Tokens generated.
    pub tokens: u32,
    /// Its first output came this long after it was sent upstream (told once).
    pub first_token_ms: Option<u32>,
}

/// Flags of an encoded [`Charge`]: which of its optional events follow.
const CHARGE_DISPATCHED: u8 = 1;
const CHARGE_DONE: u8 = 2;

/// The scheduler tells a worker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToWorker {
    /// Resume the request towards `endpoint` (an index into the configured
    /// endpoints); `predicted_ttft_ms` is the estimator's prediction made when
    /// it was queued, when there was one and the configuration exposes it.
    Dispatch { req: RequestId, endpoint: u32, predicted_ttft_ms: Option<u32> },
    /// Answer the request with this outcome.
    Reject { req: RequestId, outcome: Outcome },
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take<const N: usize>(&mut self) -> Option<[u8; N]> {
        let (head, rest) = self.0.split_first_chunk::<N>()?;
        self.0 = rest;
        Some(*head)
    }
    /// A band's code; `None` for a code no sluice worker writes.
    fn band(&mut self) -> Option<Criticality> {
        Criticality::ALL.get(usize::from(self.u8()?)).copied()
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
    fn req(&mut self) -> Option<RequestId> {
        self.u64().map(RequestId)
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
                b.extend_from_slice(&req.0.to_le_bytes());
                b.push(band_code(*band));
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
                b.extend_from_slice(&req.0.to_le_bytes());
            }
            ToScheduler::Charge(c) => {
                // Tag, request, band, flags; the bypass if flagged; the output; the tenant.
                b.push(3);
                b.extend_from_slice(&c.req.0.to_le_bytes());
                b.push(band_code(c.band));
                let flags = if c.dispatched.is_some() { CHARGE_DISPATCHED } else { 0 }
                    | if c.done.is_some() { CHARGE_DONE } else { 0 };
                b.push(flags);
                if let Some(d) = &c.dispatched {
                    b.extend_from_slice(&d.input_tokens.to_le_bytes());
                    b.extend_from_slice(&d.max_tokens.to_le_bytes());
                    put_str16(&mut b, &d.model);
                }
                b.extend_from_slice(&c.output.tokens.to_le_bytes());
                put_opt_u32(&mut b, c.output.first_token_ms);
                if let Some(d) = &c.done {
                    put_opt_u32(&mut b, d.prompt_tokens);
                    put_opt_u32(&mut b, d.cached_tokens);
                }
                b.extend_from_slice(c.tenant.as_bytes());
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
                req: r.req()?,
                band: r.band()?,
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
                let req = r.req()?;
                r.0.is_empty().then_some(ToScheduler::Cancel { req })
            }
            3 => {
                let (req, band, flags) = (r.req()?, r.band()?, r.u8()?);
                if flags & !(CHARGE_DISPATCHED | CHARGE_DONE) != 0 {
                    return None;
                }
                let dispatched = if flags & CHARGE_DISPATCHED != 0 {
                    Some(Dispatched { input_tokens: r.u32()?, max_tokens: r.u32()?, model: r.str16()? })
                } else {
                    None
                };
                let output = Output { tokens: r.u32()?, first_token_ms: r.opt_u32()? };
                let done = if flags & CHARGE_DONE != 0 {
                    Some(Done { prompt_tokens: r.opt_u32()?, cached_tokens: r.opt_u32()? })
                } else {
                    None
                };
                Some(ToScheduler::Charge(Charge { req, band, tenant: r.rest_str()?, dispatched, output, done }))
            }
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
                b.extend_from_slice(&req.0.to_le_bytes());
                b.extend_from_slice(&endpoint.to_le_bytes());
                put_opt_u32(&mut b, *predicted_ttft_ms);
            }
            ToWorker::Reject { req, outcome } => {
                b.push(2);
                b.extend_from_slice(&req.0.to_le_bytes());
                b.push(outcome.code());
            }
        }
        b
    }

    /// Decodes; `None` for bytes no sluice scheduler wrote.
    pub fn decode(bytes: &[u8]) -> Option<ToWorker> {
        let mut r = Reader(bytes);
        let m = match r.u8()? {
            1 => ToWorker::Dispatch { req: r.req()?, endpoint: r.u32()?, predicted_ttft_ms: r.opt_u32()? },
            2 => ToWorker::Reject { req: r.req()?, outcome: Outcome::from_code(r.u8()?)? },
            _ => return None,
        };
        r.0.is_empty().then_some(m)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A charge of request `req` of tenant `t` (shared with the worker's tests).
    pub(crate) fn charge(
        req: u64,
        dispatched: Option<Dispatched>,
        tokens: u32,
        first: Option<u32>,
        done: Option<Done>,
    ) -> ToScheduler {
        let output = Output { tokens, first_token_ms: first };
        ToScheduler::Charge(Charge {
            req: RequestId(req),
            band: Criticality::Standard,
            tenant: "t".into(),
            dispatched,
            output,
            done,
        })
    }

    #[test]
    fn messages_round_trip() {
        let to_sched = [
            ToScheduler::Enqueue {
                req: RequestId(u64::MAX - 1),
                band: Criticality::Sheddable,
                input_tokens: 17,
                max_tokens: 256,
                arrival_ms: 1_700_000_000_123,
                deadline: Some(Deadline { at_ms: 1_700_000_020_123, ttft_ms: 20_000 }),
                route: RouteInfo { session: Some(0), model: "llama-ä".into(), prefix: vec![1, u64::MAX] },
                tenant: "tenant-ä".into(),
            },
            ToScheduler::Enqueue {
                req: RequestId(0),
                band: Criticality::Critical,
                input_tokens: 0,
                max_tokens: 0,
                arrival_ms: 0,
                deadline: None,
                route: RouteInfo::default(),
                tenant: String::new(),
            },
            ToScheduler::Cancel { req: RequestId(42) },
            ToScheduler::Wake,
            charge(
                3 << 32 | 9,
                Some(Dispatched { input_tokens: 7, max_tokens: 30, model: "m".into() }),
                5,
                Some(120),
                Some(Done { prompt_tokens: Some(4000), cached_tokens: Some(3072) }),
            ),
            // A bypass of an empty prompt is a dispatch all the same.
            charge(1, Some(Dispatched::default()), 0, None, None),
            charge(2, None, 0, None, None),
            charge(2, None, u32::MAX, Some(0), Some(Done::default())),
        ];
        for m in to_sched {
            let bytes = m.encode();
            assert_eq!(ToScheduler::decode(&bytes), Some(m.clone()));
            if let ToScheduler::Charge(c) = &m {
                // The events are told by their flags, never by a value.
                let flags = bytes[10];
                assert_eq!(flags & CHARGE_DISPATCHED != 0, c.dispatched.is_some(), "{m:?}");
                assert_eq!(flags & CHARGE_DONE != 0, c.done.is_some(), "{m:?}");
            }
        }
        for m in [
            ToWorker::Dispatch { req: RequestId(9), endpoint: 2, predicted_ttft_ms: None },
            ToWorker::Dispatch { req: RequestId(9), endpoint: 2, predicted_ttft_ms: Some(1234) },
            ToWorker::Reject { req: RequestId(1), outcome: Outcome::SloUnattainable },
        ] {
            assert_eq!(ToWorker::decode(&m.encode()), Some(m));
        }
    }

    #[test]
    fn request_ids_name_their_worker_and_stream_and_band_codes_round_trip() {
        let id = RequestId::new(3, 9);
        assert_eq!((id, id.worker(), id.ctx()), (RequestId(3 << 32 | 9), 3, 9));
        assert_eq!(worker_of(id.0), 3);
        for (code, band) in Criticality::ALL.into_iter().enumerate() {
            assert_eq!(band_code(band), code as u8);
            assert_eq!(band_of_code(code as u8), band);
        }
        assert_eq!(band_of_code(200), Criticality::Standard, "an unknown code is the default band");
    }

    #[test]
    fn batches_round_trip_and_damage_spoils_the_whole_entry() {
        let msgs = vec![
            ToScheduler::Cancel { req: RequestId(1) },
            charge(2, Some(Dispatched { input_tokens: 3, max_tokens: 4, model: String::new() }), 5, None, None),
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
        let mut unknown_event = charge(1, None, 0, None, None).encode();
        unknown_event[10] = 4;
        assert_eq!(ToScheduler::decode(&unknown_event), None, "an event this scheduler does not know");
        assert_eq!(ToWorker::decode(&[1, 0]), None);
        let reject = ToWorker::Reject { req: RequestId(1), outcome: Outcome::QueueFull };
        assert_eq!(ToWorker::decode(&reject.encode()[..5]), None);
        let mut long = ToWorker::Dispatch { req: RequestId(1), endpoint: 0, predicted_ttft_ms: None }.encode();
        long.push(0);
        assert_eq!(ToWorker::decode(&long), None);
    }
}
