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
