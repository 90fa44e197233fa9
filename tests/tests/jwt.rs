//! Tenants from an authenticated identity, through real Envoy with the reference configuration's
//! authentication (`envoy/envoy.yaml`: the client's tenant header removed, then `jwt_authn`
//! copying the token's `tenant` claim into it, then sluice), with ES256 tokens signed here by a
//! key made for the run (its public half is the JWKS Envoy is given).
//!
//! Which tenant sluice schedules a request as is read from its per-tenant queue bound: with one
//! slot, held, and `flow_capacity: 1`, a tenant's second request is refused with 429
//! `rejected-flow-capacity` while another tenant's is queued.

mod common;

use common::*;
use ring::rand::SystemRandom;
use ring::signature::{EcdsaKeyPair, KeyPair, ECDSA_P256_SHA256_FIXED_SIGNING};
use serde_json::{json, Value};
use sluice_e2e::config::{with_overrides, JwtAuth, PLACEHOLDER_ISSUER, REFERENCE_AUDIENCE, TENANT_HEADER};
use sluice_e2e::raw_http;
use sluice_e2e::{default_plugin_config, serial, Backends, ChatRequest, Envoy, EnvoyOptions, LoadClient, Outcome};
use std::net::SocketAddr;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Unpadded base64url (RFC 7515's encoding of every JWS part).
fn b64(bytes: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::new();
    for c in bytes.chunks(3) {
        let n = c.iter().enumerate().fold(0u32, |n, (i, &b)| n | u32::from(b) << (16 - 8 * i));
        for i in 0..=c.len() {
            out.push(A[(n >> (18 - 6 * i) & 63) as usize] as char);
        }
    }
    out
}

/// An issuer's signing key (P-256, ES256).
struct Issuer {
    key: EcdsaKeyPair,
    rng: SystemRandom,
}

impl Issuer {
    fn new() -> Self {
        let rng = SystemRandom::new();
        let pkcs8 = EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, &rng).expect("a P-256 key");
        let key = EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, pkcs8.as_ref(), &rng).expect("its pkcs8");
        Self { key, rng }
    }

    /// The JWKS of its public key (an uncompressed point: 0x04, x, y).
    fn jwks(&self) -> String {
        let p = self.key.public_key().as_ref();
        json!({"keys": [{"kty": "EC", "crv": "P-256", "alg": "ES256", "use": "sig", "kid": "test",
                         "x": b64(&p[1..33]), "y": b64(&p[33..65])}]})
        .to_string()
    }

    /// A compact JWS of `claims`.
    fn sign(&self, claims: &Value) -> String {
        let header = json!({"alg": "ES256", "typ": "JWT", "kid": "test"});
        let input = format!("{}.{}", b64(header.to_string().as_bytes()), b64(claims.to_string().as_bytes()));
        let sig = self.key.sign(&self.rng, input.as_bytes()).expect("signing");
        format!("{input}.{}", b64(sig.as_ref()))
    }
}

fn now_s() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs()
}

/// Claims the reference provider accepts, naming `tenant` (none: no tenant claim).
fn claims(tenant: Option<&str>) -> Value {
    let mut c = json!({"iss": PLACEHOLDER_ISSUER, "aud": REFERENCE_AUDIENCE, "sub": "user-1",
                       "iat": now_s(), "exp": now_s() + 3600});
    if let Some(t) = tenant {
        c["tenant"] = t.into();
    }
    c
}

/// A small chat request with `token` and, if given, a tenant header of the client's choosing.
fn request(token: Option<&str>, forged_tenant: Option<&str>, max_tokens: u32) -> ChatRequest {
    let mut r = ChatRequest::chat(forged_tenant, max_tokens);
    if let Some(t) = token {
        r.headers.push(("authorization".into(), format!("Bearer {t}")));
    }
    r
}

async fn send(client: &LoadClient, addr: SocketAddr, r: &ChatRequest) -> Outcome {
    client.send(addr, r, Instant::now()).await
}

/// One backend behind Envoy with `jwt`'s filters before sluice: one slot (about 25 ms a token,
/// so the blocker's 480 tokens, which fit the profile's 512-token context, hold it for seconds)
/// and one queued request per tenant.
async fn start(name: &str, jwt: JwtAuth) -> anyhow::Result<(Envoy, Backends)> {
    let pool = Backends::start(backends(1, 0.04)).await?;
    let pc = with_overrides(
        default_plugin_config(&pool.endpoints(), "fcfs"),
        json!({"lower_bound_per_backend": 1, "upper_bound_per_backend": 1, "flow_capacity": 1}),
    );
    assert_eq!(jwt.header, TENANT_HEADER);
    let envoy = Envoy::start(EnvoyOptions { jwt: Some(jwt), ..EnvoyOptions::with_filter(name, pc) }).await?;
    Ok((envoy, pool))
}

/// A request of `max_tokens` sent in the background.
fn spawn(client: &LoadClient, addr: SocketAddr, r: ChatRequest) -> tokio::task::JoinHandle<Outcome> {
    let c = client.clone();
    tokio::spawn(async move { send(&c, addr, &r).await })
}

/// Sends `r` and checks that sluice refused it for its tenant's full queue.
async fn assert_tenant_full(client: &LoadClient, addr: SocketAddr, r: &ChatRequest, what: &str) {
    let o = send(client, addr, r).await;
    assert_eq!(o.status, Some(429), "{what}: {o:?}");
    assert_outcome_reject(&o, &["rejected-flow-capacity"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tenant_is_the_verified_tokens_claim_and_bad_tokens_never_reach_a_backend() -> anyhow::Result<()> {
    let _g = serial();
    let issuer = Issuer::new();
    let (envoy, _pool) = start("jwt", JwtAuth { jwks: issuer.jwks(), ..JwtAuth::reference() }).await?;
    let addr = envoy.listener;
    let client = LoadClient::new(Duration::from_secs(60));
    let spawn = |r: ChatRequest| spawn(&client, addr, r);

    // A valid token reaches the backend.
    let o = send(&client, addr, &request(Some(&issuer.sign(&claims(Some("alice")))), None, 4)).await;
    assert!(o.ok() && o.tokens == 4, "a valid token was refused: {o:?}\n{}", envoy.log_tail(3000));

    // The blocker takes the one slot; everything after it waits in the queue.
    let blocker = spawn(request(Some(&issuer.sign(&claims(Some("blocker")))), None, 480));
    envoy.wait_stats("the blocker dispatched", Duration::from_secs(10), |s| s.value("sluice_stock") == 1.0).await?;
    // alice's one queued request fills her flow.
    let alice = spawn(request(Some(&issuer.sign(&claims(Some("alice")))), None, 4));
    envoy.wait_stats("alice queued", Duration::from_secs(10), |s| s.value("sluice_queue_length") == 1.0).await?;

    // alice's token with bob's header: scheduled as alice, so her full flow refuses it.
    let forged = request(Some(&issuer.sign(&claims(Some("alice")))), Some("bob"), 4);
    assert_tenant_full(&client, addr, &forged, "alice's token with a forged tenant header").await;

    // A valid token without the claim: the default tenant, queued beside alice's.
    let anonymous = spawn(request(Some(&issuer.sign(&claims(None))), None, 4));
    envoy
        .wait_stats("the default tenant queued", Duration::from_secs(10), |s| s.value("sluice_queue_length") == 2.0)
        .await?;
    // Such a token with a tenant header of the client's choosing: still the default tenant (the
    // header was removed), whose flow is full.
    let forged = request(Some(&issuer.sign(&claims(None))), Some("carol"), 4);
    assert_tenant_full(&client, addr, &forged, "a token without the claim and a forged tenant header").await;

    // Bad or missing tokens: jwt_authn's 401 (403 for a token meant for another audience), before
    // sluice (nothing more queued or refused by it) and before any backend.
    let before = envoy.stats().await?;
    let foreign = Issuer::new();
    let mut expired = claims(Some("alice"));
    expired["exp"] = (now_s() - 3600).into();
    let mut other_audience = claims(Some("alice"));
    other_audience["aud"] = "someone-else".into();
    let mut other_issuer = claims(Some("alice"));
    other_issuer["iss"] = "https://evil.example.com".into();
    let unsigned =
        format!("{}.{}.", b64(br#"{"alg":"none","typ":"JWT"}"#), b64(claims(Some("alice")).to_string().as_bytes()));
    let bad = [
        ("expired", Some(issuer.sign(&expired)), 401),
        ("signed by another key", Some(foreign.sign(&claims(Some("alice")))), 401),
        ("another audience", Some(issuer.sign(&other_audience)), 403),
        ("another issuer", Some(issuer.sign(&other_issuer)), 401),
        ("unsigned", Some(unsigned), 401),
        ("garbage", Some("not-a-jwt".to_string()), 401),
        ("missing", None, 401),
    ];
    for (what, token, status) in &bad {
        let r = request(token.as_deref(), Some("alice"), 4);
        let mut headers: Vec<(&str, &str)> = r.headers.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        headers.push((TENANT_HEADER, "dave"));
        let body = r.body().to_string();
        let resp = raw_http::request(addr, "POST", &r.path, &headers, body.as_bytes(), Duration::from_secs(10)).await?;
        assert_eq!(resp.status, *status, "{what} token: {} {}", resp.status, resp.text());
        assert!(resp.header("x-sluice-reject-reason").is_none(), "{what} token reached sluice: {resp:?}");
    }
    let after = envoy.stats().await?;
    for stat in [
        "sluice_requests_queued",
        "sluice_requests_bypassed",
        "sluice_requests_rejected_flow_capacity",
        "sluice_requests_rejected_bad_request",
    ] {
        assert_eq!(after.value(stat), before.value(stat), "{stat}: a bad token reached sluice");
    }
    assert_eq!(upstream_requests(&after), upstream_requests(&before), "a bad token reached a backend");

    // The blocker's client leaves; the queued requests are served.
    blocker.abort();
    for (who, t) in [("alice", alice), ("the default tenant", anonymous)] {
        let o = t.await?;
        assert!(o.ok() && o.tokens == 4, "{who}'s queued request: {o:?}");
    }
    Ok(())
}

/// With `allow_missing` (not the reference's choice, documented as the alternative), a request
/// without a token is let through as the default tenant, whatever tenant header it carries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_token_the_tenant_header_is_removed_all_the_same() -> anyhow::Result<()> {
    let _g = serial();
    let issuer = Issuer::new();
    let jwt = JwtAuth { jwks: issuer.jwks(), allow_missing: true, ..JwtAuth::reference() };
    let (envoy, _pool) = start("jwt-allow-missing", jwt).await?;
    let addr = envoy.listener;
    let client = LoadClient::new(Duration::from_secs(60));
    let blocker = spawn(&client, addr, request(Some(&issuer.sign(&claims(Some("blocker")))), None, 480));
    envoy.wait_stats("the blocker dispatched", Duration::from_secs(10), |s| s.value("sluice_stock") == 1.0).await?;
    // No token: the default tenant, whose one queued request fills its flow.
    let anonymous = spawn(&client, addr, request(None, None, 4));
    envoy
        .wait_stats("the default tenant queued", Duration::from_secs(10), |s| s.value("sluice_queue_length") == 1.0)
        .await?;
    assert_tenant_full(&client, addr, &request(None, Some("carol"), 4), "no token and a forged tenant header").await;
    // A token still names its tenant, and a bad one is still refused.
    let alice = spawn(&client, addr, request(Some(&issuer.sign(&claims(Some("alice")))), Some("default"), 4));
    envoy.wait_stats("alice queued", Duration::from_secs(10), |s| s.value("sluice_queue_length") == 2.0).await?;
    let mut expired = claims(Some("alice"));
    expired["exp"] = (now_s() - 3600).into();
    let o = send(&client, addr, &request(Some(&issuer.sign(&expired)), None, 4)).await;
    assert_eq!(o.status, Some(401), "an expired token: {o:?}");
    blocker.abort();
    for (who, t) in [("the default tenant", anonymous), ("alice", alice)] {
        let o = t.await?;
        assert!(o.ok() && o.tokens == 4, "{who}'s queued request: {o:?}");
    }
    Ok(())
}
