//! Tests of the model fingerprint: a pinned digest (the encoding never drifts), every field
//! changes it (property test), and each validation refuses what it should.

use proptest::prelude::*;

use super::*;

fn geometry() -> LayoutConfig {
    LayoutConfig {
        num_blocks: 8,
        num_layers: 32,
        outer_dim: 2,
        page_size: 16,
        inner_dim: 1024,
        dtype_bytes: 2,
    }
}

fn base() -> FingerprintBuilder {
    ModelFingerprint::builder()
        .model("meta-llama/Llama-3.1-8B")
        .dtype("bfloat16")
        .kv_layout("NHD")
        .geometry(geometry())
        .kv_group(0)
        .parallelism(Parallelism::Rank { rank: 0, world: 1 })
}

/// The digest of `base()`, pinned: a change of the encoding or context must be deliberate
/// (and makes every stored block a miss).
const PINNED: &str = "ae3ef77f92002e46fc8f24cbab5ad5dc";

#[test]
fn digest_is_pinned() {
    let fp = base().build().unwrap();
    assert_eq!(fp.to_hex(), PINNED);
    assert_eq!(fp.key_segment(), format!("fp-{PINNED}"));
    assert_eq!(fp.to_string(), fp.key_segment());
    assert_eq!(fp.to_hex().len(), 2 * FINGERPRINT_LEN);
    assert_ne!(fp.short(), 0);
}

#[test]
fn engine_parts_are_bound_by_name_whatever_the_order_given() {
    let a = base().part("b", "2").part("a", "1").build().unwrap();
    let b = base().part("a", "1").part("b", "2").build().unwrap();
    assert_eq!(a, b);
    // No parts is the pinned digest; a part with an empty value is a part.
    assert_ne!(base().part("a", "").build().unwrap().to_hex(), PINNED);
    // A name and value do not run together across parts.
    assert_ne!(
        base().part("ab", "c").build().unwrap(),
        base().part("a", "bc").build().unwrap()
    );
}

#[test]
fn block_count_is_not_bound() {
    let a = base().build().unwrap();
    let b = base()
        .geometry(LayoutConfig {
            num_blocks: 1,
            ..geometry()
        })
        .build()
        .unwrap();
    assert_eq!(a, b);
}

#[test]
fn missing_and_invalid_parts_are_refused() {
    let cases: Vec<(FingerprintBuilder, &str)> = vec![
        (ModelFingerprint::builder(), "model id"),
        (base().model(""), "model id"),
        (base().model("a\nb"), "model id"),
        (base().model("x".repeat(MAX_NAME_LEN + 1)), "model id"),
        (base().dtype(""), "dtype"),
        (base().kv_layout(""), "KV layout"),
        (base().dtype("float32"), "dtype_bytes = 2"),
        (base().dtype("fp8_e4m3"), "dtype_bytes = 2"),
        (
            base().geometry(LayoutConfig {
                page_size: 0,
                ..geometry()
            }),
            "page_size",
        ),
        (
            base().parallelism(Parallelism::Rank { rank: 2, world: 2 }),
            "rank 2",
        ),
        (
            base().parallelism(Parallelism::Rank { rank: 0, world: 0 }),
            "world size 0",
        ),
        (
            base().parallelism(Parallelism::Engine {
                tp: 2,
                pp: 0,
                pcp: 1,
                dcp: 1,
            }),
            "pp must be at least 1",
        ),
        (base().part("", "1"), "engine part name"),
        (
            base().part("layers", "x".repeat(MAX_PART_VALUE_LEN + 1)),
            "engine part layers",
        ),
    ];
    for (b, needle) in cases {
        let e = b.build().expect_err(needle).to_string();
        assert!(e.contains(needle), "{e} should name {needle}");
    }
    // An unknown dtype name is accepted as given; a known one in another case is checked.
    base().dtype("my-custom-2-byte").build().unwrap();
    assert!(base().dtype("FLOAT32").build().is_err());
}

/// One change to one field of the fingerprint's inputs.
#[derive(Debug, Clone)]
enum Change {
    Model(String),
    Dtype(String),
    KvLayout(String),
    Layers(usize),
    Outer(usize),
    Page(usize),
    Inner(usize),
    DtypeBytes(usize),
    Group(u32),
    Parallelism(Parallelism),
    /// Sets (or adds) one engine part.
    Part(String, String),
}

fn name() -> impl Strategy<Value = String> {
    "[a-zA-Z0-9_./@-]{1,24}"
}

fn parallelism() -> impl Strategy<Value = Parallelism> {
    prop_oneof![
        Just(Parallelism::Canonical),
        (1usize..9)
            .prop_flat_map(|w| (0..w).prop_map(move |r| Parallelism::Rank { rank: r, world: w })),
        (1usize..9, 1usize..5, 1usize..3, 1usize..3)
            .prop_map(|(tp, pp, pcp, dcp)| Parallelism::Engine { tp, pp, pcp, dcp }),
    ]
}

#[derive(Debug, Clone)]
struct Inputs {
    model: String,
    dtype: String,
    kv_layout: String,
    g: LayoutConfig,
    group: u32,
    p: Parallelism,
    parts: std::collections::BTreeMap<String, String>,
}

impl Inputs {
    fn build(&self) -> ModelFingerprint {
        let b = ModelFingerprint::builder()
            .model(&self.model)
            .dtype(&self.dtype)
            .kv_layout(&self.kv_layout)
            .geometry(self.g)
            .kv_group(self.group)
            .parallelism(self.p);
        self.parts
            .iter()
            .fold(b, |b, (k, v)| b.part(k, v))
            .build()
            .unwrap()
    }

    fn apply(&self, c: &Change) -> Inputs {
        let mut o = self.clone();
        match c.clone() {
            Change::Model(s) => o.model = s,
            Change::Dtype(s) => o.dtype = s,
            Change::KvLayout(s) => o.kv_layout = s,
            Change::Layers(v) => o.g.num_layers = v,
            Change::Outer(v) => o.g.outer_dim = v,
            Change::Page(v) => o.g.page_size = v,
            Change::Inner(v) => o.g.inner_dim = v,
            Change::DtypeBytes(v) => o.g.dtype_bytes = v,
            Change::Group(v) => o.group = v,
            Change::Parallelism(p) => o.p = p,
            Change::Part(k, v) => {
                o.parts.insert(k, v);
            }
        }
        o
    }

    /// Whether `c` leaves the inputs as they are.
    fn unchanged_by(&self, c: &Change) -> bool {
        let o = self.apply(c);
        o.model == self.model
            && o.dtype == self.dtype
            && o.kv_layout == self.kv_layout
            && o.g == self.g
            && o.group == self.group
            && o.p == self.p
            && o.parts == self.parts
    }
}

fn inputs() -> impl Strategy<Value = Inputs> {
    (
        name(),
        // "x-" keeps generated dtype names unknown, so any dtype_bytes is valid.
        name().prop_map(|s| format!("x-{s}")),
        name(),
        (1usize..128, 1usize..3, 1usize..257, 1usize..4097, 1usize..5),
        any::<u32>(),
        parallelism(),
        proptest::collection::btree_map(name(), "[ -~]{0,12}", 0..3),
    )
        .prop_map(
            |(model, dtype, kv_layout, (l, o, p, i, d), group, par, parts)| Inputs {
                model,
                dtype,
                kv_layout,
                g: LayoutConfig {
                    num_blocks: 1,
                    num_layers: l,
                    outer_dim: o,
                    page_size: p,
                    inner_dim: i,
                    dtype_bytes: d,
                },
                group,
                p: par,
                parts,
            },
        )
}

fn change() -> impl Strategy<Value = Change> {
    prop_oneof![
        name().prop_map(Change::Model),
        name().prop_map(|s| Change::Dtype(format!("x-{s}"))),
        name().prop_map(Change::KvLayout),
        (1usize..128).prop_map(Change::Layers),
        (1usize..3).prop_map(Change::Outer),
        (1usize..257).prop_map(Change::Page),
        (1usize..4097).prop_map(Change::Inner),
        (1usize..5).prop_map(Change::DtypeBytes),
        any::<u32>().prop_map(Change::Group),
        parallelism().prop_map(Change::Parallelism),
        (name(), "[ -~]{0,12}").prop_map(|(k, v)| Change::Part(k, v)),
    ]
}

proptest! {
    /// The same inputs give the same fingerprint; changing any one field changes it.
    #[test]
    fn every_field_matters(i in inputs(), c in change()) {
        let a = i.build();
        prop_assert_eq!(a, i.clone().build());
        let b = i.apply(&c).build();
        if i.unchanged_by(&c) {
            prop_assert_eq!(a, b);
        } else {
            prop_assert_ne!(a, b, "{:?} did not change the fingerprint", c);
        }
    }

    /// Field boundaries are length-prefixed: moving bytes from one name to the next changes
    /// the digest.
    #[test]
    fn names_do_not_run_together(a in name(), b in name(), split in 1usize..8) {
        let joined = format!("{a}{b}");
        let split = split.min(joined.len() - 1).max(1);
        let (m, d) = joined.split_at(split);
        let i = Inputs {
            model: a.clone(),
            dtype: format!("x-{b}"),
            kv_layout: "NHD".into(),
            g: geometry(),
            group: 0,
            p: Parallelism::Canonical,
            parts: Default::default(),
        };
        let j = Inputs { model: m.to_string(), dtype: format!("x-{d}"), ..i.clone() };
        if (m, d) != (a.as_str(), b.as_str()) {
            prop_assert_ne!(i.build(), j.build());
        }
    }
}
