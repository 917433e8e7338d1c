//! Adoption of host tensors laid out as vLLM lays out its KV caches: geometry read from shapes
//! and strides, each refusal, blocks moved to G2 and back through a transfer manager (read and
//! checked with the engine's own indexing, not kvbm's layout), and the owner's lifetime.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use super::*;
use crate::layout::LayoutKind;
use crate::storage::{HostStorage, PinPolicy};
use crate::transfer::{TransferManager, TransferOptions};

const NB: usize = 8; // blocks
const T: usize = 4; // tokens per block
const H: usize = 2; // heads
const D: usize = 8; // head size
const E: usize = 2; // bytes per element (fp16)
const PAGE: usize = T * H * D; // elements per page

/// An engine's KV cache: one buffer per layer, and a flag raised when it is freed.
struct Engine {
    layers: Vec<HostStorage>,
    freed: Arc<AtomicBool>,
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.freed.store(true, Ordering::SeqCst);
    }
}

fn engine(layers: usize, bytes: usize) -> (Arc<Engine>, Arc<AtomicBool>) {
    let freed = Arc::new(AtomicBool::new(false));
    let e = Engine {
        layers: (0..layers)
            .map(|_| HostStorage::new(bytes, PinPolicy::Unpinned).unwrap())
            .collect(),
        freed: freed.clone(),
    };
    (Arc::new(e), freed)
}

/// vLLM's FlashAttention shape `(2, NB, T, H, D)`; `hnd`: the same logical shape over memory
/// ordered `(2, NB, H, T, D)` (vLLM's `HND` stride order).
fn flash_attn(addr: u64, hnd: bool) -> TensorDesc {
    let shape = vec![2, NB, T, H, D];
    let strides = if hnd {
        vec![NB * PAGE, PAGE, D, T * D, 1]
    } else {
        vec![NB * PAGE, PAGE, H * D, D, 1]
    };
    TensorDesc {
        addr,
        shape,
        strides,
        elem_bytes: E,
        device: TensorDevice::Host,
    }
}

fn descs(e: &Engine, hnd: bool) -> Vec<TensorDesc> {
    e.layers
        .iter()
        .map(|l| flash_attn(l.as_ptr() as u64, hnd))
        .collect()
}

/// The engine's page `(layer, kv, block)`, by its own indexing (`(kv * NB + block) * PAGE`).
#[allow(clippy::mut_from_ref)]
fn page(e: &Engine, layer: usize, kv: usize, block: usize) -> &mut [u8] {
    let off = (kv * NB + block) * PAGE * E;
    // SAFETY: inside the layer's buffer; the tests touch a page only while no transfer runs.
    unsafe { &mut e.layers[layer].as_mut_slice()[off..off + PAGE * E] }
}

fn pattern(layer: usize, kv: usize, block: usize, salt: u8) -> Vec<u8> {
    (0..PAGE * E)
        .map(|i| (i as u8) ^ (layer as u8 * 31) ^ (kv as u8 * 7) ^ (block as u8 * 13) ^ salt)
        .collect()
}

fn g2(n: usize, layers: usize) -> PhysicalLayout {
    let l = BlockLayout::builder()
        .num_blocks(n)
        .num_layers(layers)
        .outer_dim(2)
        .page_size(T)
        .inner_dim(H * D)
        .dtype_bytes(E)
        .fully_contiguous()
        .build()
        .unwrap();
    PhysicalLayout::allocate_host(l, PinPolicy::Unpinned).unwrap()
}

fn move_blocks(
    tm: &TransferManager,
    src: crate::LayoutHandle,
    s: &[usize],
    dst: crate::LayoutHandle,
    d: &[usize],
) {
    // SAFETY: the test's layouts; nothing else touches their blocks while it runs.
    let out = unsafe { tm.execute_transfer(src, s, dst, d, TransferOptions::default()) }
        .unwrap()
        .wait();
    assert_eq!(out.failures().count(), 0, "every block moved");
}

#[test]
fn vllm_flash_attention_caches_read_as_outer_contiguous_layers() {
    for hnd in [false, true] {
        let (e, _) = engine(3, 2 * NB * PAGE * E);
        let (layout, span) = kv_layout_of(&descs(&e, hnd), KvDims::FLASH_ATTN).unwrap();
        assert_eq!(
            layout.kind(),
            LayoutKind::LayerSeparate(BlockDim::OuterContiguous)
        );
        let c = layout.config();
        assert_eq!(
            (
                c.num_blocks,
                c.num_layers,
                c.outer_dim,
                c.page_size,
                c.inner_dim,
                c.dtype_bytes
            ),
            (NB, 3, 2, T, H * D, E)
        );
        assert_eq!(span, 2 * NB * PAGE * E);
    }
}

#[test]
fn flash_infer_mla_and_cross_layer_caches_read_as_their_kinds() {
    let host =
        |addr: u64, shape: &[usize]| TensorDesc::contiguous(addr, shape, E, TensorDevice::Host);
    let fi = kv_layout_of(&[host(4096, &[NB, 2, T, H, D])], KvDims::FLASH_INFER).unwrap();
    assert_eq!(
        fi.0.kind(),
        LayoutKind::LayerSeparate(BlockDim::BlockContiguous)
    );
    let mla = kv_layout_of(&[host(4096, &[NB, T, 576])], KvDims::MLA).unwrap();
    assert_eq!(
        mla.0.kind(),
        LayoutKind::LayerSeparate(BlockDim::BlockContiguous)
    );
    assert_eq!(
        (mla.0.config().outer_dim, mla.0.config().inner_dim),
        (1, 576)
    );
    let cross = KvDims {
        blocks: 0,
        layers: Some(1),
        kv: Some(2),
        tokens: 3,
    };
    let all = kv_layout_of(&[host(4096, &[NB, 5, 2, T, H, D])], cross).unwrap();
    assert_eq!(all.0.kind(), LayoutKind::FullyContiguous);
    assert_eq!(all.0.config().num_layers, 5);
    assert_eq!(all.1, NB * 5 * 2 * PAGE * E);
}

#[test]
fn every_rule_is_refused_by_name() {
    let base = flash_attn(4096, false);
    let refused = |ts: &[TensorDesc], dims: KvDims| -> String {
        kv_layout_of(ts, dims).unwrap_err().to_string()
    };
    let with = |f: &dyn Fn(&mut TensorDesc)| {
        let mut t = base.clone();
        f(&mut t);
        t
    };
    // A padded page (the block stride leaves room after each page).
    let padded = with(&|t| {
        t.strides = vec![NB * (PAGE + 64), PAGE + 64, H * D, D, 1];
    });
    assert!(refused(&[padded], KvDims::FLASH_ATTN).contains("neither as [blocks, kv, page]"));
    // A sliced head dimension (the page is not dense).
    let sliced = with(&|t| {
        t.strides = vec![NB * T * H * 16, T * H * 16, H * 16, 16, 1];
    });
    assert!(refused(&[sliced], KvDims::FLASH_ATTN).contains("page is not dense"));
    // Tensors that disagree, or overlap.
    let other = TensorDesc {
        addr: 1 << 30,
        shape: vec![2, NB + 1, T, H, D],
        ..base.clone()
    };
    assert!(refused(&[base.clone(), other], KvDims::FLASH_ATTN).contains("tensor 1: shape"));
    let overlap = TensorDesc {
        addr: base.addr + 64,
        ..base.clone()
    };
    assert!(refused(&[base.clone(), overlap], KvDims::FLASH_ATTN).contains("overlaps tensor 0"));
    // Dimensions named wrong.
    let twice = KvDims {
        tokens: 1,
        ..KvDims::FLASH_ATTN
    };
    assert!(refused(std::slice::from_ref(&base), twice).contains("named twice"));
    let beyond = KvDims {
        tokens: 9,
        ..KvDims::FLASH_ATTN
    };
    assert!(refused(std::slice::from_ref(&base), beyond).contains("dimension 9 named"));
    // Malformed descriptions.
    let odd = with(&|t| t.addr = 4097);
    assert!(refused(&[odd], KvDims::FLASH_ATTN).contains("not aligned"));
    let short = with(&|t| t.strides.pop().map(drop).unwrap_or(()));
    assert!(refused(&[short], KvDims::FLASH_ATTN).contains("5 dimensions but 4 strides"));
    assert!(refused(&[], KvDims::FLASH_ATTN).contains("none given"));
}

#[test]
fn device_tensors_need_the_cuda_feature_and_a_driver() {
    if crate::cuda::cuda_available() {
        return; // a GPU machine: `cuda::tests::gpu_adopted_tensors` covers it
    }
    let (e, freed) = engine(1, 2 * NB * PAGE * E);
    let mut t = descs(&e, false);
    t[0].device = TensorDevice::Cuda(0);
    let owner: Owner = e.clone();
    // SAFETY: refused before any memory is touched.
    let err = unsafe { adopt_kv_tensors(&t, KvDims::FLASH_ATTN, owner) }.unwrap_err();
    assert!(
        matches!(err, PhysicalError::NotSupported(ref m) if m.contains("CUDA device 0")),
        "{err}"
    );
    drop(e);
    assert!(freed.load(Ordering::SeqCst), "a refusal keeps no reference");
}

#[test]
fn adopted_blocks_go_to_g2_and_back_into_the_engines_pages() {
    for hnd in [false, true] {
        let layers = 3;
        let (e, freed) = engine(layers, 2 * NB * PAGE * E);
        for l in 0..layers {
            for kv in 0..2 {
                for b in 0..NB {
                    page(&e, l, kv, b).copy_from_slice(&pattern(l, kv, b, 0));
                }
            }
        }
        let tm = TransferManager::new().unwrap();
        let owner: Owner = e.clone();
        // SAFETY: the engine's buffers live as long as `owner`; the test writes pages only
        // while no transfer runs.
        let g1 = unsafe { adopt_kv_tensors(&descs(&e, hnd), KvDims::FLASH_ATTN, owner) }.unwrap();
        let g1 = tm.register_layout(g1).unwrap();
        let g2h = tm.register_layout(g2(4, layers)).unwrap();

        // Offload engine blocks 3, 0, 5 into G2 blocks 0, 1, 2: each G2 block holds the
        // engine's pages in (layer, kv) order.
        move_blocks(&tm, g1, &[3, 0, 5], g2h, &[0, 1, 2]);
        let g2l = tm.layout(g2h).unwrap();
        for (slot, block) in [(0, 3), (1, 0), (2, 5)] {
            let mut want = Vec::new();
            for l in 0..layers {
                for kv in 0..2 {
                    want.extend(pattern(l, kv, block, 0));
                }
            }
            let (addr, len) = g2l.block_span(slot).unwrap();
            // SAFETY: G2's live host memory; no transfer runs.
            let got = unsafe { std::slice::from_raw_parts(addr as *const u8, len) };
            assert!(
                got == want.as_slice(),
                "G2 block {slot} (engine block {block}, hnd {hnd})"
            );
        }

        // Onboard them into engine blocks 6, 7, 1 (cleared first).
        for l in 0..layers {
            for kv in 0..2 {
                for b in [6, 7, 1] {
                    page(&e, l, kv, b).fill(0);
                }
            }
        }
        move_blocks(&tm, g2h, &[0, 1, 2], g1, &[6, 7, 1]);
        for (block, from) in [(6, 3), (7, 0), (1, 5)] {
            for l in 0..layers {
                for kv in 0..2 {
                    assert_eq!(
                        &*page(&e, l, kv, block),
                        pattern(l, kv, from, 0).as_slice(),
                        "engine page (layer {l}, kv {kv}, block {block})"
                    );
                }
            }
        }
        // Untouched blocks are untouched.
        assert_eq!(&*page(&e, 2, 1, 4), pattern(2, 1, 4, 0).as_slice());

        // The engine's memory outlives the layout: freed only once nothing of kvbm holds it.
        drop(e);
        assert!(!freed.load(Ordering::SeqCst), "held while registered");
        tm.unregister_layout(g1).unwrap();
        drop(tm);
        assert!(
            freed.load(Ordering::SeqCst),
            "freed once the layout is gone"
        );
    }
}
