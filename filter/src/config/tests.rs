//! The configuration parser's tests.

use super::*;

#[test]
fn defaults_follow_the_queuing_design() {
    let c = Config::from_json(br#"{"endpoints":["127.0.0.1:8001"]}"#).unwrap();
    assert_eq!(c.tenant_header, "x-gateway-inference-fairness-id");
    assert_eq!(c.max_tenants, 10_000);
    assert_eq!(c.default_tenant, "default");
    assert_eq!(c.policy, tagged::<PolicySpec>("p", "policy", "vtc".into()).unwrap());
    assert_eq!(c.order, OrderSpec::Fifo);
    assert_eq!(
        c.bands,
        BandLimits { total_capacity: 1000, flow_capacity: 100, ttl_ms: 30_000, critical_reserve: 0 },
        "no critical requests can exist, so nothing is reserved for them"
    );
    let critical = br#"{"endpoints":["127.0.0.1:1"],"criticality_header":"x-c","flow_capacity":900}"#;
    let reserve = Config::from_json(critical).unwrap().bands.critical_reserve;
    assert_eq!(reserve, 500, "flow_capacity, at most half the queue");
    assert_eq!(c.default_criticality, Criticality::Standard);
    assert!(c.band_min_share.is_strict(), "strict priority between bands");
    assert_eq!(c.engine_priority, None, "the body goes as the client sent it");
    assert!(c.criticality_header.is_none() && c.overload.is_none() && c.replicas.is_none());
    assert_eq!(c.bounds.cap, None, "no fixed cap: the engine's limit is learned");
    assert_eq!(c.learned_limit, Some(Headroom::default()));
    let capped = Config::from_json(br#"{"endpoints":["127.0.0.1:1"],"watermark_per_backend":2}"#).unwrap();
    let cap = capped.bounds.cap.unwrap();
    assert!((cap.upper_per_backend - 2.2).abs() < 1e-9);
    assert!((cap.lower_per_backend - 1.8).abs() < 1e-9);
    let off = Config::from_json(br#"{"endpoints":["127.0.0.1:1"],"learned_limit":null}"#).unwrap();
    assert_eq!(off.learned_limit, None);
}

#[test]
fn errors_name_the_field_and_value() {
    let cases: &[(&str, &str)] = &[
        (r#"{}"#, "endpoints"),
        (r#"{"endpoints":[]}"#, "endpoints"),
        (r#"{"endpoints":["backend:80"]}"#, "backend:80"),
        (r#"{"endpoints":["127.0.0.1:1"],"policy":"lottery"}"#, "lottery"),
        (r#"{"endpoints":["127.0.0.1:1"],"flow_capacity":0}"#, "flow_capacity"),
        (r#"{"endpoints":["127.0.0.1:1"],"max_body_bytes":67108865}"#, "max_body_bytes"),
        (r#"{"endpoints":["127.0.0.1:1"],"max_tenant_bytes":0}"#, "max_tenant_bytes"),
        (
            r#"{"endpoints":["127.0.0.1:1"],"routing":{"prefix_block_tokens":4611686018427387904}}"#,
            "prefix_block_tokens",
        ),
        (r#"{"endpoints":["127.0.0.1:1"],"max_tenant_bytes":3}"#, "default_tenant"),
        (r#"{"endpoints":["127.0.0.1:1"],"max_tenants":0}"#, "max_tenants"),
        (r#"{"endpoints":["127.0.0.1:1"],"replicas":{"id":1,"peers":2}}"#, "replicas.peers_cluster"),
        (r#"{"endpoints":["127.0.0.1:1"],"replicas":{"id":1,"peers":2,"peers_cluster":"p","ttl":1}}"#, "replicas"),
        (r#"{"endpoints":["127.0.0.1:1"],"bounds_deviation_fraction":1.5}"#, "bounds_deviation_fraction"),
        (r#"{"endpoints":["127.0.0.1:1"],"lower_bound_per_backend":1}"#, "upper_bound_per_backend"),
        (r#"{"endpoints":["127.0.0.1:1"],"endpoint":["x"]}"#, "endpoint"),
        (r#"{"endpoints":["127.0.0.1:1"],"vtc":{"output":-1}}"#, "vtc"),
        (
            r#"{"endpoints":["127.0.0.1:1"],"policy":{"policy":"vtc","output_weight":"x"}}"#,
            "field `policy`: invalid type: string \"x\"",
        ),
        (r#"{"endpoints":["127.0.0.1:1"],"policy":"rpm"}"#, "requests_per_minute"),
        (r#"{"endpoints":["127.0.0.1:1"],"order":"lifo"}"#, "lifo"),
        (r#"{"endpoints":["127.0.0.1:1"],"criticality_by_tenant":{"a":"urgent"}}"#, "criticality_by_tenant.a"),
        (r#"{"endpoints":["127.0.0.1:1"],"total_capacity":10,"critical_reserve":10}"#, "critical_reserve"),
        (r#"{"endpoints":["127.0.0.1:1"],"overload":{"defer_above":0.9}}"#, "overload"),
        (r#"{"endpoints":["127.0.0.1:1"],"overload":{"medium_from_tokens":512}}"#, "medium_from_tokens"),
        (r#"{"endpoints":["127.0.0.1:1"],"overload":{"short_max_tokens":300}}"#, "short_max_tokens"),
        (r#"{"endpoints":["127.0.0.1:1"],"overload":{"tail_window_requests":0}}"#, "overload.tail_window_requests"),
        (r#"{"endpoints":["127.0.0.1:1"],"order":"slo_slack","slo":{},"policy":"drr"}"#, "field `order`"),
        (r#"{"endpoints":["127.0.0.1:1"],"order":"pard"}"#, "needs an `slo` object"),
        (r#"{"endpoints":["127.0.0.1:1"],"default_output_tokens":0}"#, "default_output_tokens"),
        (r#"{"endpoints":["127.0.0.1:1"],"slo":{"by_band":{"critical":"x"}}}"#, "slo.by_band.critical"),
        (r#"{"endpoints":["127.0.0.1:1"],"slo":{"by_band":{"urgent":"x"}}}"#, "slo.by_band"),
        (r#"{"endpoints":["127.0.0.1:1"],"order":"edf","policy":"drr"}"#, "field `order`: `edf`"),
        (
            r#"{"endpoints":["127.0.0.1:1"],"order":"edf","policy":{"policy":"rpm","requests_per_minute":5}}"#,
            "field `order`: `edf`",
        ),
        (r#"{"endpoints":["127.0.0.1:1"],"slo":{"default":"gold"}}"#, "slo.default"),
        (r#"{"endpoints":["127.0.0.1:1"],"slo":{"drop":{"quantile":0.2}}}"#, "slo.drop.quantile"),
        (r#"{"endpoints":["127.0.0.1:1"],"order":"lbf"}"#, "`slo_slack` or `pard`"),
        (r#"{"endpoints":["127.0.0.1:1"],"tenant_header_aliases":[""]}"#, "tenant_header_aliases"),
        (r#"{"endpoints":["127.0.0.1:1"],"band_min_share":{"standard":1}}"#, "band_min_share.standard"),
        (r#"{"endpoints":["127.0.0.1:1"],"band_min_share":{"sheddable":-0.5}}"#, "band_min_share.sheddable"),
        (r#"{"endpoints":["127.0.0.1:1"],"band_min_share":{"standard":0.5,"sheddable":0.5}}"#, "band_min_share"),
        (r#"{"endpoints":["127.0.0.1:1"],"band_min_share":{"critical":0.1}}"#, "band_min_share.critical"),
        (r#"{"endpoints":["127.0.0.1:1"],"band_min_share":{"bulk":0.1}}"#, "band_min_share"),
        (r#"{"endpoints":["127.0.0.1:1"],"band_min_share":{"standard":"x"}}"#, "band_min_share"),
        (r#"{"endpoints":["127.0.0.1:1"],"engine_priority":"tgi"}"#, "engine_priority"),
        (r#"{"endpoints":["127.0.0.1:1"],"engine_priority":7}"#, "engine_priority"),
        (r#"{"endpoints":["127.0.0.1:1"],"engine_priority":{"values":{"critical":0}}}"#, "standard is missing"),
        (
            r#"{"endpoints":["127.0.0.1:1"],"engine_priority":{"values":{"critical":0,"standard":"x","sheddable":2}}}"#,
            "engine_priority.values",
        ),
        (
            r#"{"endpoints":["127.0.0.1:1"],"engine_priority":{"field":"","values":{"critical":0,"standard":1,"sheddable":2}}}"#,
            "engine_priority.field",
        ),
        (
            r#"{"endpoints":["127.0.0.1:1"],"engine_priority":{"field":"model","values":{"critical":0,"standard":1,"sheddable":2}}}"#,
            "engine_priority.field",
        ),
        (r#"{"endpoints":["127.0.0.1:1"],"engine_priority":{"feild":"p"}}"#, "feild"),
        (r#"{"endpoints":["127.0.0.1:1"],"queue_ttl_ms":"soon"}"#, "`queue_ttl_ms`: invalid type: string \"soon\""),
        (
            r#"{"endpoints":["127.0.0.1:1"],"routing":{"saturation":{"queue_depth":"x"}}}"#,
            "routing.saturation.queue_depth",
        ),
        (
            r#"{"endpoints":["127.0.0.1:1"],"routing":{"scrape_cluster":"c","saturation":{"staleness_ms":200}}}"#,
            "routing.saturation.staleness_ms",
        ),
        (
            r#"{"endpoints":["127.0.0.1:1"],"routing":{"saturation":{"affinity_overflow":0.5}}}"#,
            "routing.saturation.affinity_overflow",
        ),
        (r#"{"endpoints":["127.0.0.1:1"],"routing":{"saturation":{"queue_ms":-1}}}"#, "routing.saturation.queue_ms"),
        (r#"{"endpoints":["127.0.0.1:1"],"routing":{"scrape_interval_ms":800}}"#, "routing.max_scrape_interval_ms"),
        (
            r#"{"endpoints":["127.0.0.1:1"],"routing":{"queue_scrape_interval_ms":600}}"#,
            "routing.queue_scrape_interval_ms` (600) must be within",
        ),
        (
            r#"{"endpoints":["127.0.0.1:1"],"routing":{"scrape_interval_ms":100,"queue_scrape_interval_ms":60}}"#,
            "routing.queue_scrape_interval_ms",
        ),
        (r#"{"endpoints":["127.0.0.1:1"],"tick_ms":0}"#, "tick_ms"),
        (r#"not json"#, "invalid plugin configuration"),
        (r#"{"endpoints":["127.0.0.1:1"],"policy":"vtc","policy":"fcfs"}"#, "duplicate field `policy`"),
        (r#"{"endpoints":["127.0.0.1:1","127.0.0.1:1"]}"#, "listed twice"),
        (r#"{"endpoints":[{"address":"127.0.0.1:1","model_server":"tgi"}]}"#, "endpoints[0]"),
        (r#"{"endpoints":["127.0.0.1:1",7]}"#, "endpoints[1]"),
        (r#"{"endpoints":["127.0.0.1:1"],"routing":{"weights":{"kv_cache":-2}}}"#, "routing.weights.kv_cache"),
        (r#"{"endpoints":["127.0.0.1:1"],"routing":{"weights":{"kv":1}}}"#, "routing.weights.kv"),
        (r#"{"endpoints":["127.0.0.1:1"],"routing":{"weights":{"queue":"x"}}}"#, "routing.weights.queue"),
        (r#"{"endpoints":["127.0.0.1:1"],"routing":{"weights":[1]}}"#, "routing.weights"),
        (
            r#"{"endpoints":["127.0.0.1:1"],"routing":{"affinity_guard":{"max_ratio":0.5}}}"#,
            "routing.affinity_guard.max_ratio",
        ),
        (
            r#"{"endpoints":["127.0.0.1:1"],"routing":{"affinity_guard":{"max_extra":-1}}}"#,
            "routing.affinity_guard.max_extra",
        ),
        (r#"{"endpoints":["127.0.0.1:1"],"routing":{"affinity_guard":{"abs":1}}}"#, "abs"),
        (r#"{"endpoints":["127.0.0.1:1"],"routing":{"prefix_max_blocks":0}}"#, "routing.prefix_max_blocks"),
        (r#"{"endpoints":["127.0.0.1:1"],"routing":{"prefix_max_blocks":5000}}"#, "routing.prefix_max_blocks"),
        (r#"{"endpoints":["127.0.0.1:1"],"routing":{"speculative_ttl_ms":-1}}"#, "routing.speculative_ttl_ms"),
        (r#"{"endpoints":["127.0.0.1:1"],"routing":{"metrics_path":"metrics"}}"#, "routing.metrics_path"),
        (r#"{"endpoints":["127.0.0.1:1"],"routing":{"picker":"best"}}"#, "best"),
        (r#"{"endpoints":["127.0.0.1:1"],"routing":{"scrape_every":5}}"#, "scrape_every"),
    ];
    for (json, needle) in cases {
        let err = Config::from_json(json.as_bytes()).unwrap_err();
        assert!(err.contains(needle), "{json}: error {err:?} does not name {needle}");
    }
}

#[test]
fn routing_defaults_and_per_endpoint_model_servers() {
    let c = Config::from_json(
        br#"{"endpoints":["127.0.0.1:1",{"address":"127.0.0.1:2","model_server":"sglang"}],
             "routing":{"scrape_cluster":"model_servers","model_server":"trtllm","session_header":"X-Session"}}"#,
    )
    .unwrap();
    let r = &c.routing;
    assert_eq!(r.model_servers, vec![ModelServer::Trtllm, ModelServer::Sglang]);
    assert_eq!((r.scrape_interval_ms, r.metrics_path.as_str(), r.prefix_block_bytes), (50, "/metrics", 64));
    assert_eq!((r.queue_scrape_interval_ms, r.max_scrape_interval_ms), (250, 500));
    let interval = |routing: &str| {
        let c =
            Config::from_json(format!(r#"{{"endpoints":["127.0.0.1:1"],"routing":{routing}}}"#).as_bytes()).unwrap();
        (c.routing.scrape_interval_ms, c.routing.queue_scrape_interval_ms, c.routing.max_scrape_interval_ms)
    };
    assert_eq!(interval(r#"{"scrape_interval_ms":300}"#), (300, 300, 500), "unset: within the other two");
    assert_eq!(interval(r#"{"max_scrape_interval_ms":100}"#), (50, 100, 100));
    assert_eq!(interval(r#"{"queue_scrape_interval_ms":50}"#), (50, 50, 500));
    assert_eq!(r.router.weights, Weights::default());
    assert_eq!(r.router.guard, Some(LoadGuard::default()));
    assert_eq!((r.prefix_max_blocks, r.speculative_ttl_ms), (512, 2000));
    assert_eq!(r.prefix_hashing(), PrefixHashing { block_bytes: 64, max_blocks: 512 });
    assert_eq!(r.saturation, SaturationThresholds::default());
    assert_eq!(r.session_header.as_deref(), Some("x-session"));
    assert_eq!(r.on_no_endpoint, NoEndpoint::FailOpen);
    // Not scraping: least-request only.
    let c = Config::from_json(br#"{"endpoints":["127.0.0.1:1"]}"#).unwrap();
    assert!(c.routing.scrape_cluster.is_none());
    assert_eq!(c.routing.router.weights, Weights::only("in_flight", 1.0).unwrap());
    assert_eq!(c.routing.prefix_hashing(), PrefixHashing::OFF, "no prefix scorer, no hashing");
    // A partial weights map overrides the defaults it names; `null` turns the guard off.
    let c = Config::from_json(
        br#"{"endpoints":["127.0.0.1:1"],"routing":{"scrape_cluster":"c","weights":{"cost":0,"session":2},
             "affinity_guard":null,"prefix_max_blocks":16}}"#,
    )
    .unwrap();
    let w = &c.routing.router.weights;
    assert_eq!((w.get("cost"), w.get("session"), w.get("in_flight")), (0.0, 2.0, 1.0));
    assert_eq!(c.routing.prefix_hashing(), PrefixHashing::OFF, "neither `prefix` nor `cost`: no hashing");
    assert_eq!(c.routing.router.guard, None);
    assert_eq!(c.routing.prefix_max_blocks, 16);
}

#[test]
fn every_policy_of_the_library_is_selectable() {
    for p in [
        r#""fcfs""#,
        r#""lcf""#,
        r#""vtc""#,
        r#"{"policy":"vtc","weights":{"gold":2}}"#,
        r#"{"policy":"vtc_cost","cost":"profiled"}"#,
        r#""vtc_predict""#,
        r#"{"policy":"rpm","requests_per_minute":30}"#,
        r#""wfq""#,
        r#""drr""#,
    ] {
        let c = Config::from_json(format!(r#"{{"endpoints":["127.0.0.1:1"],"policy":{p}}}"#).as_bytes());
        assert!(c.is_ok(), "{p}: {:?}", c.err());
    }
    let rpm = br#"{"endpoints":["127.0.0.1:1"],"policy":{"policy":"rpm","requests_per_minute":5}}"#;
    assert!(!Config::from_json(rpm).unwrap().bypass, "a rate limit must see every request");
    assert!(Config::from_json(br#"{"endpoints":["127.0.0.1:1"]}"#).unwrap().bypass);
    for o in [r#""edf""#, r#""shortest_predicted""#, r#"{"order":"feasible_set"}"#] {
        let c = Config::from_json(format!(r#"{{"endpoints":["127.0.0.1:1"],"order":{o}}}"#).as_bytes());
        assert!(c.is_ok(), "{o}: {:?}", c.err());
    }
    let c = Config::from_json(
        br#"{"endpoints":["127.0.0.1:1"],"criticality_header":"X-Criticality","criticality_by_tenant":{"batch":"sheddable"},
             "slo":{"objectives":{"fast":{"ttft_ms":2000}},"by_band":{"critical":"fast"}},"overload":{}}"#,
    )
    .unwrap();
    assert_eq!(c.criticality_header.as_deref(), Some("x-criticality"));
    assert_eq!(c.criticality_by_tenant["batch"], Criticality::Sheddable);
    assert_eq!(c.band_ttft_ms[&Criticality::Critical], 2000);
    assert!(c.slo.is_none(), "objectives by band alone run no estimator");
    assert_eq!(c.overload, Some(OverloadLadder::default()));
    let c = Config::from_json(br#"{"endpoints":["127.0.0.1:1"],"band_min_share":{"standard":0.2,"sheddable":0.05}}"#)
        .unwrap();
    assert_eq!(
        (c.band_min_share.get(Criticality::Standard), c.band_min_share.get(Criticality::Sheddable)),
        (0.2, 0.05)
    );
}

#[test]
fn engine_priority_presets_and_custom_fields() {
    let read = |v: &str| {
        Config::from_json(format!(r#"{{"endpoints":["127.0.0.1:1"],"engine_priority":{v}}}"#).as_bytes())
            .unwrap()
            .engine_priority
    };
    let vllm = read(r#""vllm""#).unwrap();
    assert_eq!((vllm.field.as_str(), vllm.values), ("priority", [0, 1, 2]), "vLLM: lower goes first");
    let sglang = read(r#""sglang""#).unwrap();
    assert!(sglang.value(Criticality::Critical) > sglang.value(Criticality::Sheddable), "SGLang: higher goes first");
    let custom = read(r#"{"field":"x-prio","values":{"critical":-5,"standard":0,"sheddable":5}}"#).unwrap();
    assert_eq!((custom.field.as_str(), custom.value(Criticality::Standard)), ("x-prio", 0));
    assert_eq!(read(r#"{"values":{"critical":9,"standard":8,"sheddable":7}}"#).unwrap().field, "priority");
    assert_eq!(read("null"), None);
}

#[test]
fn explicit_bounds_are_a_cap() {
    let c = Config::from_json(
        br#"{"endpoints":["127.0.0.1:1"],"lower_bound_per_backend":1,"upper_bound_per_backend":4,"tenant_header":"X-Tenant"}"#,
    )
    .unwrap();
    assert_eq!(c.bounds.cap, Some(StockBounds::explicit(1.0, 4.0).unwrap()));
    assert_eq!(c.tenant_header, "x-tenant");
}

/// A configuration around `extra` (members of the top-level object).
fn with(extra: serde_json::Value) -> Vec<u8> {
    let mut c = serde_json::json!({"endpoints": ["127.0.0.1:1"]});
    c.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    c.to_string().into_bytes()
}

/// `value` at the dotted `path` of an otherwise empty object.
fn at_path(path: &str, value: serde_json::Value) -> serde_json::Value {
    path.rsplit('.').fold(value, |v, k| serde_json::json!({ k: v }))
}

/// A configuration that uses the new name of a rename, and parses.
fn using_new(path: &str) -> serde_json::Value {
    match path {
        "policy.weights" => serde_json::json!({"policy": {"policy": "wfq", "weights": {"a": 2}}}),
        "default_output_tokens" => serde_json::json!({"default_output_tokens": 512}),
        "bounds_deviation_fraction" => serde_json::json!({"bounds_deviation_fraction": 0.2}),
        "slo.by_band" => {
            serde_json::json!({"slo": {"objectives": {"f": {"ttft_ms": 100}}, "by_band": {"critical": "f"}}})
        }
        "order" => serde_json::json!({"order": "pard", "slo": {}}),
        other => panic!("no example of `{other}`: add one"),
    }
}

#[test]
fn every_old_name_is_refused_with_its_replacement_and_every_new_one_parses() {
    for r in RENAMED_KEYS {
        let err = Config::from_json(&with(at_path(r.old, 1.into()))).unwrap_err();
        let want = format!("field `{}` was renamed to `{}`", r.old, r.new);
        assert!(err.contains(&want), "{}: {err}", r.old);
        let c = Config::from_json(&with(using_new(r.new)));
        assert!(c.is_ok(), "{}: {:?}", r.new, c.err());
    }
    for r in RENAMED_VALUES {
        let want = format!("value \"{}\" of `{}` is now \"{}\"", r.old, r.key, r.new);
        for written in [serde_json::json!(r.old), serde_json::json!({ r.key: r.old })] {
            let err = Config::from_json(&with(serde_json::json!({ r.key: written }))).unwrap_err();
            assert!(err.contains(&want), "{}: {err}", r.old);
        }
        let new = match r.new {
            "vtc_cost" => serde_json::json!({"policy": "vtc_cost", "cost": "profiled"}),
            n => serde_json::json!(n),
        };
        let c = Config::from_json(&with(serde_json::json!({ r.key: new })));
        match r.new {
            "vtc_oracle" => assert!(c.unwrap_err().contains("simulator-only"), "a gateway refuses the oracle"),
            _ => assert!(c.is_ok(), "{}: {:?}", r.new, c.err()),
        }
    }
}

#[test]
fn one_output_prior_reaches_every_user() {
    let c = Config::from_json(&with(serde_json::json!({
        "default_output_tokens": 99, "policy": "wfq", "order": "shortest_predicted", "overload": {},
        "slo": {"ttft_headers": ["x-slo-ttft-ms"]}
    })))
    .unwrap();
    assert!(matches!(c.policy, PolicySpec::Wfq { default_output_tokens: 99, .. }));
    assert_eq!(c.order, OrderSpec::ShortestPredicted { default_output_tokens: 99 });
    assert_eq!(c.overload.unwrap().default_output_tokens, 99);
    assert_eq!(c.slo.unwrap().prior_output_tokens, 99);
    let c = Config::from_json(&with(serde_json::json!({"order": "feasible_set"}))).unwrap();
    assert_eq!(c.order, OrderSpec::FeasibleSet(sluice_policies::order::FeasibleSet::default()), "256 by default");
}

#[test]
fn the_slo_order_is_an_order() {
    let c = Config::from_json(&with(serde_json::json!({"order": "slo_slack", "slo": {}}))).unwrap();
    assert_eq!((c.order, c.slo.unwrap().order), (OrderSpec::Fifo, SloOrder::Slack));
    let c = Config::from_json(&with(serde_json::json!({"order": "edf", "slo": {}}))).unwrap();
    assert_eq!((c.order, c.slo.unwrap().order), (OrderSpec::Edf, SloOrder::Fair));
}
