//! Tests of the configuration tree: precedence of file, environment and overrides, and the
//! errors for a wrong type, an unknown key, an unknown tier and out-of-range values.

use std::io::Write;

use kvbm_logical::TierId;

use super::*;

fn toml_file(text: &str) -> tempfile::NamedTempFile {
    let mut f = tempfile::Builder::new().suffix(".toml").tempfile().unwrap();
    f.write_all(text.as_bytes()).unwrap();
    f
}

fn err(result: Result<KvbmConfig>) -> (String, String) {
    match result.expect_err("must fail") {
        EngineError::Config { key, message } => (key, message),
        other => panic!("not a config error: {other}"),
    }
}

#[test]
fn defaults_build_and_validate() {
    let config = ConfigBuilder::new().build().unwrap();
    assert_eq!(config, KvbmConfig::default());
    assert_eq!(config.search_order(), vec![TierId::G2]);
}

#[test]
fn file_then_env_then_override() {
    let file = toml_file(
        "[offload.g2_to_g3]\nqueue_capacity = 10\nmax_concurrent_transfers = 3\n\
         [logical]\nblock_size = 32\n[tiers]\ng2_blocks = 7\n",
    );
    let path = file.path().to_str().unwrap().to_string();

    // File only.
    let c = ConfigBuilder::from_env_vars([(CONFIG_PATH_ENV, path.as_str())])
        .unwrap()
        .build()
        .unwrap();
    assert_eq!(c.offload.g2_to_g3.queue_capacity, 10);
    assert_eq!(c.offload.g2_to_g3.max_concurrent_transfers, 3);
    assert_eq!(c.logical.block_size, 32);
    assert_eq!(c.tiers.g2_blocks, 7);
    // Untouched keys keep their defaults, also inside a section the file sets.
    assert_eq!(c.offload.g2_to_g3.batch_config.max_batch_size, 64);
    assert_eq!(c.offload.g1_to_g2, PipelineConfig::default());

    // Env beats file; file still wins where env is silent.
    let vars = [
        (CONFIG_PATH_ENV, path.as_str()),
        ("KVBM_OFFLOAD__G2_TO_G3__QUEUE_CAPACITY", "20"),
        ("KVBM_OFFLOAD__G2_TO_G3__BATCH_CONFIG__MAX_BATCH_SIZE", "16"),
        ("KVBM_LOGICAL__BLOCK_SIZE", "64"),
        ("KVBM_TEST_SKIP_SERVICES", "1"),
        ("HOME", "/root"),
    ];
    let c = ConfigBuilder::from_env_vars(vars).unwrap().build().unwrap();
    assert_eq!(c.offload.g2_to_g3.queue_capacity, 20);
    assert_eq!(c.offload.g2_to_g3.batch_config.max_batch_size, 16);
    assert_eq!(c.offload.g2_to_g3.max_concurrent_transfers, 3);
    assert_eq!(c.logical.block_size, 64);

    // Overrides beat env and file.
    let c = ConfigBuilder::from_env_vars(vars)
        .unwrap()
        .set("offload.g2_to_g3.queue_capacity", 30)
        .set("logical.block_size", 128)
        .build()
        .unwrap();
    assert_eq!(c.offload.g2_to_g3.queue_capacity, 30);
    assert_eq!(c.logical.block_size, 128);
    assert_eq!(c.offload.g2_to_g3.batch_config.max_batch_size, 16);
    assert_eq!(c.tiers.g2_blocks, 7);
}

#[test]
fn explicit_file_replaces_env_path() {
    let a = toml_file("[tiers]\ng2_blocks = 1\n");
    let b = toml_file("[tiers]\ng2_blocks = 2\n");
    let c = ConfigBuilder::from_env_vars([(CONFIG_PATH_ENV, a.path().to_str().unwrap())])
        .unwrap()
        .file(b.path())
        .unwrap()
        .build()
        .unwrap();
    assert_eq!(c.tiers.g2_blocks, 2);
}

#[test]
fn env_arrays_and_strings_parse() {
    let c = ConfigBuilder::from_env_vars([
        ("KVBM_LEADER__SEARCH", "[G3, G2]"),
        ("KVBM_EVENTS__SUBJECT", "my.events"),
        ("KVBM_METRICS__ENABLED", "true"),
    ])
    .unwrap()
    .build()
    .unwrap();
    assert_eq!(c.leader.search, vec![TierId::G3, TierId::G2]);
    assert_eq!(c.events.subject, "my.events");
    assert!(c.metrics.enabled);
}

#[test]
fn missing_file_is_an_error() {
    let (key, message) = err(ConfigBuilder::from_env_vars([(
        CONFIG_PATH_ENV,
        "/nonexistent/kvbm.toml",
    )])
    .and_then(ConfigBuilder::build));
    assert_eq!(key, CONFIG_PATH_ENV);
    assert!(message.contains("/nonexistent/kvbm.toml"), "{message}");
}

#[test]
fn wrong_type_names_the_key_and_the_source() {
    let (key, message) = err(ConfigBuilder::from_env_vars([(
        "KVBM_OFFLOAD__G2_TO_G3__QUEUE_CAPACITY",
        "lots",
    )])
    .unwrap()
    .build());
    assert_eq!(key, "offload.g2_to_g3.queue_capacity");
    assert!(
        message.contains("KVBM_OFFLOAD__G2_TO_G3__QUEUE_CAPACITY"),
        "{message}"
    );

    let file = toml_file("[logical]\nblock_size = \"big\"\n");
    let (key, message) = err(ConfigBuilder::new().file(file.path()).unwrap().build());
    assert_eq!(key, "logical.block_size");
    assert!(message.contains(file.path().to_str().unwrap()), "{message}");
}

#[test]
fn unknown_key_names_it() {
    let file = toml_file("[offload.g2_to_g3]\nqueue_capacty = 5\n");
    let (key, message) = err(ConfigBuilder::new().file(file.path()).unwrap().build());
    assert_eq!(key, "offload.g2_to_g3.queue_capacty");
    assert!(message.contains("unknown key"), "{message}");
    assert!(
        message.contains("queue_capacity"),
        "lists the valid keys: {message}"
    );

    // An unknown section, through the environment.
    let (key, message) = err(ConfigBuilder::from_env_vars([("KVBM_OFFLAOD__X", "1")])
        .unwrap()
        .build());
    assert_eq!(key, "offlaod");
    assert!(message.contains("KVBM_OFFLAOD__X"), "{message}");

    // Through an override.
    let (key, message) = err(ConfigBuilder::new().set("events.nope", 1).build());
    assert_eq!(key, "events.nope");
    assert!(message.contains("override"), "{message}");
}

#[test]
fn unknown_tier_names_the_key() {
    let file = toml_file("[leader]\nsearch = [\"G2\", \"G5\"]\n");
    let (key, message) = err(ConfigBuilder::new().file(file.path()).unwrap().build());
    assert!(key.starts_with("leader.search"), "{key}");
    assert!(message.contains("unknown tier `G5`"), "{message}");
    assert!(message.contains("G1, G2, G3, G4"), "{message}");

    let (key, _) = err(ConfigBuilder::new().set("leader.search", ["G1"]).build());
    assert_eq!(key, "leader.search");
}

#[test]
fn out_of_range_values_name_the_key() {
    let cases: &[(&str, i64, &str)] = &[
        (
            "offload.g2_to_g3.batch_config.max_batch_size",
            0,
            "offload.g2_to_g3.batch_config.max_batch_size",
        ),
        (
            "offload.g2_to_g4.pipeline.queue_capacity",
            0,
            "offload.g2_to_g4.pipeline.queue_capacity",
        ),
        (
            "offload.g2_to_g4.lock_ttl_ms",
            5,
            "offload.g2_to_g4.lock_ttl_ms",
        ),
        ("logical.block_size", 24, "logical.block_size"),
        ("runtime.worker_threads", 0, "runtime.worker_threads"),
        (
            "physical.transfer.worker_nice",
            20,
            "physical.transfer.worker_nice",
        ),
        ("events.channel_capacity", 0, "events.channel_capacity"),
        ("physical.object.tp_rank", 1, "physical.object.tp_rank"),
        (
            "transport.request_timeout_ms",
            0,
            "transport.request_timeout_ms",
        ),
    ];
    for (set, value, expect) in cases {
        let (key, message) = err(ConfigBuilder::new().set(*set, *value).build());
        assert_eq!(&key, expect, "setting {set} = {value}: {message}");
    }
    let (key, message) = err(ConfigBuilder::new().set("metrics.bind", "nowhere").build());
    assert_eq!(key, "metrics.bind");
    assert!(message.contains("nowhere"), "{message}");
    let (key, _) = err(ConfigBuilder::new().set("tiers.g3_blocks", 8).build());
    assert_eq!(key, "physical.disk");
    let (key, _) = err(ConfigBuilder::new().set("tiers.g4_blocks", 8).build());
    assert_eq!(key, "physical.s3");
    ConfigBuilder::new()
        .set("tiers.g4_blocks", 8)
        .set("physical.object_dir", "/tmp/kvbm-g4")
        .build()
        .expect("G4 in a local directory");
    let (key, message) = err(ConfigBuilder::new().set("tiers.block_bytes", 1000).build());
    assert_eq!(key, "tiers.block_bytes");
    assert!(message.contains("4096"), "{message}");
}

#[test]
fn the_error_displays_key_first() {
    let e = ConfigBuilder::new()
        .set("offload.g2_to_g3.batch_config.max_batch_size", 0)
        .build()
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "offload.g2_to_g3.batch_config.max_batch_size: must be at least 1"
    );
}

#[test]
fn tiering_section_is_validated_when_present() {
    let c = ConfigBuilder::new()
        .set("tiering.num_chunks", 100)
        .build()
        .unwrap();
    assert_eq!(c.tiering.unwrap().num_chunks, Some(100));
    let (key, _) = err(ConfigBuilder::new()
        .set("tiering.num_chunks", 100)
        .set("tiering.blocks_per_chunk", 0)
        .build());
    assert_eq!(key, "tiering.blocks_per_chunk");
}

#[test]
#[allow(clippy::result_large_err)] // figment's Jail fixes the closure's error type
fn figment_jail_process_env() {
    // The process-environment path, isolated by figment's Jail (it serialises env access).
    figment::Jail::expect_with(|jail| {
        jail.create_file("kvbm.toml", "[tiers]\ng2_blocks = 5\n")?;
        jail.set_env(CONFIG_PATH_ENV, "kvbm.toml");
        jail.set_env("KVBM_EVENTS__CHANNEL_CAPACITY", "9");
        let c = ConfigBuilder::from_process_env()
            .map_err(|e| e.to_string())?
            .build()
            .map_err(|e| e.to_string())?;
        assert_eq!(c.tiers.g2_blocks, 5);
        assert_eq!(c.events.channel_capacity, 9);
        Ok(())
    });
}

#[test]
fn unknown_tier_message_reads_well() {
    let file = toml_file("[leader]\nsearch = [\"G2\", \"G5\"]\n");
    let e = ConfigBuilder::new()
        .file(file.path())
        .unwrap()
        .build()
        .unwrap_err();
    let text = e.to_string();
    assert!(
        text.starts_with(
            "leader.search.1: unknown tier `G5` (expected one of: G1, G2, G3, G4) (in "
        ),
        "{text}"
    );
}

#[test]
fn the_cli_replay_section_is_carried_unparsed() {
    let file = toml_file("[replay]\nseed = 7\n[replay.s3]\nregion = \"x\"\n");
    let c = ConfigBuilder::new()
        .file(file.path())
        .unwrap()
        .build()
        .unwrap();
    let replay = c.replay.expect("carried");
    assert_eq!(
        replay.clone().find("seed").and_then(|v| v.to_i128()),
        Some(7),
        "{replay:?}"
    );
}

#[test]
fn heartbeat_timeout_must_exceed_the_interval() {
    let (key, message) = err(ConfigBuilder::new()
        .set("transport.heartbeat_interval_ms", 500)
        .set("transport.heartbeat_timeout_ms", 500)
        .build());
    assert_eq!(key, "transport.heartbeat_timeout_ms");
    assert!(message.contains("500"), "{message}");
    let (key, _) = err(ConfigBuilder::new()
        .set("transport.heartbeat_interval_ms", 0)
        .build());
    assert_eq!(key, "transport.heartbeat_interval_ms");
    let c = ConfigBuilder::new()
        .set("transport.heartbeat_interval_ms", 100)
        .set("transport.heartbeat_timeout_ms", 300)
        .build()
        .unwrap();
    assert_eq!(
        (
            c.transport.heartbeat_interval_ms,
            c.transport.heartbeat_timeout_ms
        ),
        (100, 300)
    );
}

#[test]
fn bounds_of_the_cluster_plane_are_validated_naming_their_key() {
    for key in [
        "metrics.read_timeout_ms",
        "metrics.max_connections",
        "transport.max_connections",
        "transport.response_deadline_ms",
        "transport.pull_deadline_ms",
        "transport.max_idle_peers",
        "transport.idle_expiry_ms",
        "transport.snapshot_max_pages",
        "transport.snapshot_max_entries",
        "transport.worker_max_in_flight",
    ] {
        let (k, message) = err(ConfigBuilder::new().set(key, 0).build());
        assert_eq!(k, key, "{message}");
        assert!(message.contains("> 0"), "{key}: {message}");
    }
    let config = ConfigBuilder::new()
        .set("transport.max_connections", 3)
        .set("transport.pull_deadline_ms", 1500)
        .build()
        .unwrap();
    assert_eq!(config.transport.max_connections, 3);
    assert_eq!(config.transport.pull_deadline_ms, 1500);
}

#[test]
fn model_keys_make_the_fingerprint_and_bad_ones_name_the_key() {
    let g = kvbm_physical::LayoutConfig {
        num_blocks: 4,
        num_layers: 2,
        outer_dim: 2,
        page_size: 16,
        inner_dim: 64,
        dtype_bytes: 2,
    };
    let with = |k: &str, v: &str| ConfigBuilder::new().set(k, v).build();
    let base = KvbmConfig::default().fingerprint(&g).unwrap();
    // Each key of [model], and the rank, changes the fingerprint; the block count does not.
    for (k, v) in [
        ("model.name", "m"),
        ("model.dtype", "bfloat16"),
        ("model.kv_layout", "HND"),
    ] {
        let fp = with(k, v).unwrap().fingerprint(&g).unwrap();
        assert_ne!(fp, base, "{k}");
    }
    let grouped = ConfigBuilder::new()
        .set("model.kv_group", 1)
        .build()
        .unwrap();
    assert_ne!(grouped.fingerprint(&g).unwrap(), base);
    let ranked = ConfigBuilder::new()
        .set("physical.object.tp_world_size", 2)
        .set("physical.object.tp_rank", 1)
        .build()
        .unwrap();
    assert_ne!(ranked.fingerprint(&g).unwrap(), base);
    let more = kvbm_physical::LayoutConfig { num_blocks: 9, ..g };
    assert_eq!(KvbmConfig::default().fingerprint(&more).unwrap(), base);
    // Worker processes: one rank holds the same bytes as an in-process instance (the same
    // fingerprint); several hold every rank's bytes, told apart by their number.
    let processes = |ranks: u32| {
        ConfigBuilder::new()
            .set("workers.mode", "processes")
            .set("workers.ranks", ranks)
            .set("transport.nats_url", "nats://127.0.0.1:4222")
            .build()
            .unwrap()
            .fingerprint(&g)
            .unwrap()
    };
    assert_eq!(processes(1), base);
    let (two, four) = (processes(2), processes(4));
    assert!(two != base && four != base && two != four);
    assert_ne!(two, ranked.fingerprint(&g).unwrap());
    // Invalid names are refused at build, naming the key.
    assert_eq!(err(with("model.name", "")).0, "model.name");
    assert_eq!(err(with("model.dtype", "a\tb")).0, "model.dtype");
    assert_eq!(err(with("model.kv_layout", "")).0, "model.kv_layout");
    // A known dtype of another element size than the geometry's: refused naming [model].
    let c = with("model.dtype", "float32").unwrap();
    let (key, message) = err(c.fingerprint(&g).map(|_| c.clone()));
    assert_eq!(key, "model");
    assert!(message.contains("float32"), "{message}");
}

#[test]
fn write_through_keys_are_validated_naming_their_key() {
    let with_g3 = || {
        ConfigBuilder::new()
            .set("tiers.g3_blocks", 8)
            .set("physical.disk.path", "/tmp/kvbm-g3/g3.bin")
    };
    let config = with_g3()
        .set("offload.write_through.request_level", vec!["G3"])
        .set("offload.write_through.backpressure", true)
        .set("offload.write_through.g3_watermarks", vec![0.01, 0.002])
        .build()
        .expect("a request-level G3 lane with back-pressure");
    assert_eq!(config.offload.write_through.request_level, vec![TierId::G3]);
    assert_eq!(
        config.offload.write_through.g3_watermarks,
        Some([0.01, 0.002])
    );
    let cases: Vec<(ConfigBuilder, &str, &str)> = vec![
        (
            with_g3().set("offload.write_through.request_level", vec!["G2"]),
            "offload.write_through.request_level",
            "only G3 and G4",
        ),
        (
            with_g3().set("offload.write_through.request_level", vec!["G3", "G3"]),
            "offload.write_through.request_level",
            "twice",
        ),
        (
            with_g3().set("offload.write_through.request_level", vec!["G4"]),
            "offload.write_through.request_level",
            "tiers.g4_blocks is 0",
        ),
        (
            with_g3().set("offload.write_through.g3_watermarks", vec![0.001, 0.005]),
            "offload.write_through.g3_watermarks",
            "0 < low <= high",
        ),
        (
            with_g3().set("offload.write_through.g4_watermarks", vec![0.01, 0.0]),
            "offload.write_through.g4_watermarks",
            "0 < low <= high",
        ),
        (
            with_g3().set("offload.write_through.spill", true),
            "offload.write_through.spill",
            "",
        ),
    ];
    for (builder, want, says) in cases {
        let (key, message) = err(builder.build());
        assert!(key.starts_with(want), "{key}: {message}");
        assert!(message.contains(says), "{key}: {message}");
    }
}

#[test]
fn workers_keys_are_validated_naming_the_key() {
    let default = ConfigBuilder::new().build().unwrap();
    assert_eq!(default.workers.mode, WorkersMode::InProcess);
    assert_eq!(default.workers.ranks, 1);

    let processes = || {
        ConfigBuilder::new()
            .set("workers.mode", "processes")
            .set("transport.nats_url", "nats://127.0.0.1:4222")
    };
    let config = processes().set("workers.ranks", 4).build().unwrap();
    assert_eq!(config.workers.mode, WorkersMode::Processes);
    assert_eq!(config.workers.ranks, 4);
    // One worker process may still be one rank of a wider group (its others other instances).
    processes()
        .set("physical.object.tp_world_size", 2)
        .set("physical.object.tp_rank", 1)
        .build()
        .unwrap();
    // With worker processes, G3 is each rank's own file: no [physical.disk] needed.
    processes().set("tiers.g3_blocks", 8).build().unwrap();
    // G4 with worker processes: one bucket, each rank's slices under its own directory.
    let g4 = processes()
        .set("workers.ranks", 2)
        .set("tiers.g4_blocks", 8)
        .set("physical.object_dir", "/tmp/g4")
        .build()
        .unwrap();
    for r in 0..2 {
        let o = g4.rank_object_config(r).unwrap();
        assert_eq!((o.tp_rank, o.tp_world_size), (r as usize, 2));
    }
    let e = g4.rank_object_config(2).unwrap_err();
    assert_eq!(e.config_key(), Some("workers.ranks"), "{e}");
    // One rank keeps `physical.object` as configured (it may be one rank of a wider group).
    let one = processes()
        .set("physical.object.tp_world_size", 2)
        .set("physical.object.tp_rank", 1)
        .build()
        .unwrap()
        .rank_object_config(0)
        .unwrap();
    assert_eq!((one.tp_rank, one.tp_world_size), (1, 2));
    let (key, _) = err(ConfigBuilder::new().set("tiers.g3_blocks", 8).build());
    assert_eq!(key, "physical.disk");

    let (key, message) = err(ConfigBuilder::new().set("workers.mode", "threads").build());
    assert_eq!(key, "workers.mode", "{message}");
    assert!(message.contains("processes"), "lists the modes: {message}");
    let (key, message) = err(ConfigBuilder::new().set("workers.rank", 2).build());
    assert_eq!(key, "workers.rank", "{message}");
    assert!(message.contains("unknown key"), "{message}");
    for (key, builder, says) in [
        ("workers.ranks", processes().set("workers.ranks", 0), "> 0"),
        (
            "workers.ranks",
            ConfigBuilder::new().set("workers.ranks", 2),
            "exactly one rank",
        ),
        (
            "workers.join_timeout_ms",
            processes().set("workers.join_timeout_ms", 0),
            "> 0",
        ),
        (
            "workers.control_prefix",
            processes().set("workers.control_prefix", "kvbm.*"),
            "wildcards",
        ),
        (
            "workers.control_prefix",
            processes().set("workers.control_prefix", ""),
            "subject prefix",
        ),
        (
            "physical.s3",
            processes().set("tiers.g4_blocks", 8),
            "needs a [physical.s3] section",
        ),
        (
            "transport.nats_url",
            ConfigBuilder::new().set("workers.mode", "processes"),
            "over NATS",
        ),
        (
            "physical.object.tp_world_size",
            processes()
                .set("workers.ranks", 2)
                .set("physical.object.tp_world_size", 2),
            "whole tensor-parallel group",
        ),
        (
            "physical.object.tp_world_size",
            processes()
                .set("workers.ranks", 2)
                .set("physical.object.tp_world_size", 4)
                .set("physical.object.tp_rank", 1),
            "rank 1 of 4",
        ),
    ] {
        let (k, message) = err(builder.build());
        assert_eq!(k, key, "{message}");
        assert!(message.contains(says), "{key}: {message}");
    }
}
