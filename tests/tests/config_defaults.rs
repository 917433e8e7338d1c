//! `config/kvbm.toml` is the documented default configuration: every section must parse into
//! its crate's config struct (unknown keys are errors there) and equal that struct's `Default`,
//! so the file and the code cannot drift apart.

use std::path::Path;

use serde::de::DeserializeOwned;

fn config_file() -> toml::Table {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/kvbm.toml");
    let text = std::fs::read_to_string(&path).expect("config/kvbm.toml exists");
    text.parse()
        .unwrap_or_else(|e| panic!("{} is not valid TOML: {e}", path.display()))
}

fn section<T: DeserializeOwned>(table: &toml::Table, path: &[&str]) -> T {
    let mut value = toml::Value::Table(table.clone());
    for key in path {
        value = value
            .get(key)
            .unwrap_or_else(|| panic!("config/kvbm.toml has no [{}]", path.join(".")))
            .clone();
    }
    value
        .try_into()
        .unwrap_or_else(|e| panic!("[{}] does not parse: {e}", path.join(".")))
}

#[test]
fn logical_section_is_the_default() {
    let file = config_file();
    let parsed: kvbm_logical::LogicalConfig = section(&file, &["logical"]);
    assert_eq!(parsed, kvbm_logical::LogicalConfig::default());
}

#[test]
fn offload_sections_are_the_defaults() {
    let file = config_file();
    for lane in ["g1_to_g2", "g2_to_g3"] {
        let parsed: kvbm_offload::PipelineConfig = section(&file, &["offload", lane]);
        assert_eq!(
            parsed,
            kvbm_offload::PipelineConfig::default(),
            "[offload.{lane}]"
        );
    }
    let parsed: kvbm_offload::ObjectPipelineConfig = section(&file, &["offload", "g2_to_g4"]);
    assert_eq!(parsed, kvbm_offload::ObjectPipelineConfig::default());
}

#[test]
fn a_changed_value_is_noticed() {
    // The comparison above must be able to fail: a non-default value parses and differs.
    let mut file = config_file();
    let logical = file
        .get_mut("logical")
        .and_then(|v| v.as_table_mut())
        .expect("[logical]");
    logical.insert("block_size".into(), toml::Value::Integer(32));
    let parsed: kvbm_logical::LogicalConfig = section(&file, &["logical"]);
    assert_ne!(parsed, kvbm_logical::LogicalConfig::default());
    assert_eq!(parsed.block_size, 32);
}

#[test]
fn unknown_keys_are_rejected() {
    let mut file = config_file();
    let logical = file
        .get_mut("logical")
        .and_then(|v| v.as_table_mut())
        .expect("[logical]");
    logical.insert("blok_size".into(), toml::Value::Integer(32));
    let value = file.get("logical").cloned().expect("[logical]");
    let err = value
        .try_into::<kvbm_logical::LogicalConfig>()
        .expect_err("typo must fail");
    assert!(err.to_string().contains("blok_size"), "{err}");
}

#[test]
fn physical_sections_are_the_defaults() {
    let file = config_file();
    let parsed: kvbm_physical::TransferConfig = section(&file, &["physical", "transfer"]);
    assert_eq!(parsed, kvbm_physical::TransferConfig::default());
    let parsed: kvbm_physical::ObjectConfig = section(&file, &["physical", "object"]);
    assert_eq!(parsed, kvbm_physical::ObjectConfig::default());
}

/// The commented-out example sections (`# [physical.disk]`, `# [physical.s3]`), uncommented:
/// the lines after the header up to the first line that is not a comment.
fn commented_section(name: &str) -> toml::Table {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/kvbm.toml");
    let text = std::fs::read_to_string(path).expect("config/kvbm.toml exists");
    let header = format!("# [{name}]");
    let mut lines = text.lines().skip_while(|l| l.trim() != header).skip(1);
    let mut body = String::new();
    for line in lines.by_ref() {
        let Some(entry) = line.strip_prefix("# ") else {
            break;
        };
        // Drop the trailing comment of `key = value   # comment`.
        let entry = entry.split("  #").next().unwrap_or(entry);
        body.push_str(entry);
        body.push('\n');
    }
    assert!(!body.is_empty(), "config/kvbm.toml documents [{name}]");
    body.parse()
        .unwrap_or_else(|e| panic!("[{name}] example is not valid TOML: {e}"))
}

#[test]
fn physical_examples_parse() {
    let disk: kvbm_physical::DiskConfig = toml::Value::Table(commented_section("physical.disk"))
        .try_into()
        .expect("[physical.disk] parses");
    let defaults = kvbm_physical::DiskConfig::new(&disk.path);
    assert_eq!(
        (
            disk.engine,
            disk.queue_depth,
            disk.direct_io,
            disk.buffer_pool_bytes
        ),
        (
            defaults.engine,
            defaults.queue_depth,
            defaults.direct_io,
            defaults.buffer_pool_bytes
        ),
        "[physical.disk] shows the defaults"
    );
    let s3: kvbm_physical::S3Config = toml::Value::Table(commented_section("physical.s3"))
        .try_into()
        .expect("[physical.s3] parses");
    assert_eq!(s3.region, "us-east-1");
}

#[test]
fn physical_unknown_keys_are_rejected() {
    let file = config_file();
    fn typo<T: DeserializeOwned + std::fmt::Debug>(mut table: toml::Table, what: &str) {
        table.insert("no_such_key".into(), toml::Value::Integer(1));
        let err = toml::Value::Table(table).try_into::<T>().expect_err(what);
        assert!(err.to_string().contains("no_such_key"), "{what}: {err}");
    }
    let physical = file["physical"].as_table().expect("[physical]").clone();
    typo::<kvbm_physical::TransferConfig>(
        physical["transfer"].as_table().unwrap().clone(),
        "transfer",
    );
    typo::<kvbm_physical::ObjectConfig>(physical["object"].as_table().unwrap().clone(), "object");
    typo::<kvbm_physical::S3Config>(commented_section("physical.s3"), "s3");
    typo::<kvbm_physical::DiskConfig>(commented_section("physical.disk"), "disk");
}

#[test]
fn whole_file_is_the_engine_default() {
    // The engine's tree, read through its own loader (figment, deny_unknown_fields, validation).
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/kvbm.toml");
    let parsed = kvbm_engine::ConfigBuilder::new()
        .file(&path)
        .expect("config/kvbm.toml exists")
        .build()
        .unwrap_or_else(|e| panic!("config/kvbm.toml does not load: {e}"));
    // `[replay]` belongs to kvbm-cli, which checks it against its own defaults.
    assert!(
        parsed.replay.is_some(),
        "config/kvbm.toml documents [replay]"
    );
    let parsed = kvbm_engine::KvbmConfig {
        replay: None,
        ..parsed
    };
    assert_eq!(parsed, kvbm_engine::KvbmConfig::default());
}

#[test]
fn engine_sections_are_the_defaults() {
    use kvbm_engine::config::{
        EventsConfig, LeaderConfig, MetricsConfig, RuntimeConfig, TiersConfig, TransportConfig,
    };
    let file = config_file();
    assert_eq!(
        section::<RuntimeConfig>(&file, &["runtime"]),
        RuntimeConfig::default()
    );
    assert_eq!(
        section::<TiersConfig>(&file, &["tiers"]),
        TiersConfig::default()
    );
    assert_eq!(
        section::<LeaderConfig>(&file, &["leader"]),
        LeaderConfig::default()
    );
    assert_eq!(
        section::<EventsConfig>(&file, &["events"]),
        EventsConfig::default()
    );
    assert_eq!(
        section::<MetricsConfig>(&file, &["metrics"]),
        MetricsConfig::default()
    );
    assert_eq!(
        section::<TransportConfig>(&file, &["transport"]),
        TransportConfig::default()
    );
}

#[test]
fn tiering_example_parses() {
    let spec: kvbm_tiering::OffloadingSpecConfig = toml::Value::Table(commented_section("tiering"))
        .try_into()
        .expect("[tiering] parses");
    let defaults: kvbm_tiering::OffloadingSpecConfig =
        toml::Value::Table(toml::Table::new()).try_into().unwrap();
    assert_eq!(
        kvbm_tiering::OffloadingSpecConfig {
            num_chunks: None,
            ..spec
        },
        defaults,
        "[tiering] shows the defaults"
    );
}

#[test]
#[ignore = "prints the defaults as TOML, for updating config/kvbm.toml by hand"]
fn print_defaults() {
    println!(
        "{}",
        toml::to_string(&kvbm_logical::LogicalConfig::default()).unwrap()
    );
    println!(
        "{}",
        toml::to_string(&kvbm_offload::PipelineConfig::default()).unwrap()
    );
    println!(
        "{}",
        toml::to_string(&kvbm_offload::ObjectPipelineConfig::default()).unwrap()
    );
}
