//! The hybrid cache's recurrent snapshots (docs/host-seam.md, "Serving
//! throughput" and "Recurrent state beside the KV cache"): a snapshot holds
//! exactly one slot's conv and recurrent state of every recurrent layer and a
//! restore writes it back, both while the pools lie in the arena that
//! `reserve_sequences` makes and after a pool has grown past it; writing one
//! layer's pool leaves every other layer's untouched; a new or reset slot is
//! zeroed in every layer and no other slot is touched.

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use mistralrs_core::plugin_api::{
    HybridCache, HybridCacheConfig, HybridLayerCache, HybridLayerType, RecurrentLayerConfig,
    RecurrentStatePool,
};

const CONV_DIM: usize = 6;
const CONV_WIDTH: usize = 4;
const STATE_DIMS: [usize; 3] = [2, 3, 5];

/// Three recurrent layers and an attention layer, on the CPU.
fn hybrid_cache() -> Result<HybridCache> {
    let config = HybridCacheConfig {
        layer_types: vec![
            HybridLayerType::Recurrent,
            HybridLayerType::Recurrent,
            HybridLayerType::Attention,
            HybridLayerType::Recurrent,
        ],
        max_seq_len: 64,
        recurrent: RecurrentLayerConfig {
            conv_dim: CONV_DIM,
            conv_width: CONV_WIDTH,
            state_dims: STATE_DIMS.to_vec(),
        },
    };
    Ok(HybridCache::new(config, DType::F32, &Device::Cpu)?)
}

fn pools(cache: &mut HybridCache) -> Vec<&mut RecurrentStatePool> {
    cache
        .caches
        .iter_mut()
        .filter_map(|layer| match layer {
            HybridLayerCache::Recurrent(pool) => Some(pool),
            HybridLayerCache::Attention(_) => None,
        })
        .collect()
}

/// Values no other (layer, kind, slot, element) shares: layer * 1e6 +
/// kind * 1e5 + the element's index in the pool.
fn distinct_values(layer: usize, kind: usize, dims: &[usize]) -> Result<Tensor> {
    let len: usize = dims.iter().product();
    let base = (layer * 1_000_000 + kind * 100_000) as f32;
    let values: Vec<f32> = (0..len).map(|i| base + i as f32).collect();
    Ok(Tensor::from_vec(values, dims, &Device::Cpu)?)
}

/// Writes distinct values into every slot of every recurrent pool (in place,
/// as the model's kernels write them) and returns what each pool holds.
fn fill_pools(cache: &mut HybridCache) -> Result<Vec<(Vec<f32>, Vec<f32>)>> {
    let mut written = Vec::new();
    for (layer, pool) in pools(cache).into_iter().enumerate() {
        let conv = distinct_values(layer, 0, pool.conv_state.dims())?;
        let recurrent = distinct_values(layer, 1, pool.recurrent_state.dims())?;
        pool.conv_state.slice_set(&conv, 0, 0)?;
        pool.recurrent_state.slice_set(&recurrent, 0, 0)?;
        written.push((
            conv.flatten_all()?.to_vec1()?,
            recurrent.flatten_all()?.to_vec1()?,
        ));
    }
    Ok(written)
}

/// Each pool's contents, flattened.
fn pool_contents(cache: &mut HybridCache) -> Result<Vec<(Vec<f32>, Vec<f32>)>> {
    pools(cache)
        .into_iter()
        .map(|pool| {
            Ok((
                pool.conv_state.flatten_all()?.to_vec1()?,
                pool.recurrent_state.flatten_all()?.to_vec1()?,
            ))
        })
        .collect()
}

/// `contents` (a pool's flattened values) of slot `slot`, `per_slot` values a slot.
fn slot_of(contents: &[f32], slot: usize, per_slot: usize) -> Vec<f32> {
    contents[slot * per_slot..(slot + 1) * per_slot].to_vec()
}

const CONV_PER_SLOT: usize = CONV_DIM * CONV_WIDTH;
const RECURRENT_PER_SLOT: usize = STATE_DIMS[0] * STATE_DIMS[1] * STATE_DIMS[2];

/// Snapshots `slot` with offset `offset` set in every pool and checks it
/// against `contents`, the pools' values.
fn check_snapshot(
    cache: &mut HybridCache,
    contents: &[(Vec<f32>, Vec<f32>)],
    slot: usize,
    offset: usize,
) -> Result<()> {
    for pool in pools(cache) {
        pool.set_seqlen_offset(slot, offset);
    }
    let snapshots = cache.snapshot_recurrent_state(slot)?;
    assert_eq!(snapshots.len(), 3, "one snapshot per recurrent layer");
    for (layer, (snapshot, (conv, recurrent))) in snapshots.iter().zip(contents).enumerate() {
        assert_eq!(snapshot.conv_state.dims(), [1, CONV_DIM, CONV_WIDTH]);
        assert_eq!(
            snapshot.recurrent_state.dims(),
            [1, STATE_DIMS[0], STATE_DIMS[1], STATE_DIMS[2]]
        );
        assert_eq!(
            snapshot.conv_state.flatten_all()?.to_vec1::<f32>()?,
            slot_of(conv, slot, CONV_PER_SLOT),
            "layer {layer}'s conv state of slot {slot}"
        );
        assert_eq!(
            snapshot.recurrent_state.flatten_all()?.to_vec1::<f32>()?,
            slot_of(recurrent, slot, RECURRENT_PER_SLOT),
            "layer {layer}'s recurrent state of slot {slot}"
        );
        assert_eq!(snapshot.seqlen_offset, offset);
    }
    // The snapshot is a copy: zeroing the slot leaves it as it was, and
    // restoring it brings the slot back, leaving the other slots alone.
    cache.reset_seq(slot)?;
    cache.restore_recurrent_state(slot, &snapshots)?;
    assert_eq!(
        &pool_contents(cache)?,
        contents,
        "after the restore of slot {slot}"
    );
    Ok(())
}

#[test]
fn snapshots_of_pools_in_the_arena_and_after_one_outgrew_it() -> Result<()> {
    let mut cache = hybrid_cache()?;
    cache.reserve_sequences(8)?;
    for pool in pools(&mut cache) {
        assert_eq!(pool.capacity(), 8);
    }
    // (A slot is zeroed when it is allocated: the values are written after.)
    let slots: Vec<usize> = (0..8)
        .map(|_| cache.allocate_seq().expect("a slot"))
        .collect();
    let contents = fill_pools(&mut cache)?;
    // Each layer's pool is its own: the values written through one layer are
    // not seen through another (the arena's entries do not overlap).
    assert_eq!(pool_contents(&mut cache)?, contents);
    for (i, &slot) in slots.iter().enumerate() {
        check_snapshot(&mut cache, &contents, slot, 32 * (i + 1))?;
    }

    // A ninth sequence grows every pool past the arena; their states move
    // into allocations of their own, and snapshots still hold the slot's
    // state.
    let ninth = cache.allocate_seq().expect("a slot after growing");
    for pool in pools(&mut cache) {
        assert!(pool.capacity() > 8);
    }
    let contents = fill_pools(&mut cache)?;
    check_snapshot(&mut cache, &contents, ninth, 96)?;
    check_snapshot(&mut cache, &contents, slots[3], 64)?;
    Ok(())
}

#[test]
fn snapshots_without_a_reservation() -> Result<()> {
    let mut cache = hybrid_cache()?;
    let slot = cache.allocate_seq().expect("a slot");
    let contents = fill_pools(&mut cache)?;
    check_snapshot(&mut cache, &contents, slot, 5)
}

/// Slot `slot` of every pool holds zeros, and every other slot what
/// `contents` (the pools' values before) says.
fn check_slot_zeroed(
    cache: &mut HybridCache,
    contents: &[(Vec<f32>, Vec<f32>)],
    slot: usize,
) -> Result<()> {
    let now = pool_contents(cache)?;
    for (layer, (now, before)) in now.iter().zip(contents).enumerate() {
        let kinds = [
            ("conv", CONV_PER_SLOT, &now.0, &before.0),
            ("recurrent", RECURRENT_PER_SLOT, &now.1, &before.1),
        ];
        for (kind, per_slot, now, before) in kinds {
            for other in 0..now.len() / per_slot {
                let expected = if other == slot {
                    vec![0.0; per_slot]
                } else {
                    slot_of(before, other, per_slot)
                };
                assert_eq!(
                    slot_of(now, other, per_slot),
                    expected,
                    "layer {layer}'s {kind} state of slot {other} after zeroing slot {slot}"
                );
            }
        }
    }
    Ok(())
}

/// A new sequence's slot and a reset one are zeroed in every recurrent layer
/// (in the arena, every layer's at once), their offsets back to 0, and no
/// other slot is touched; the same after a pool outgrew the arena.
#[test]
fn a_slot_is_zeroed_in_every_layer_in_the_arena_and_after_one_outgrew_it() -> Result<()> {
    let mut cache = hybrid_cache()?;
    cache.reserve_sequences(8)?;
    let slots: Vec<usize> = (0..8)
        .map(|_| cache.allocate_seq().expect("a slot"))
        .collect();
    let contents = fill_pools(&mut cache)?;
    cache.free_seq(slots[3]);
    let again = cache.allocate_seq().expect("the freed slot");
    assert_eq!(again, slots[3], "the freed slot is handed out again");
    check_slot_zeroed(&mut cache, &contents, again)?;

    let contents = fill_pools(&mut cache)?;
    for pool in pools(&mut cache) {
        pool.set_seqlen_offset(slots[5], 40);
    }
    cache.reset_seq(slots[5])?;
    check_slot_zeroed(&mut cache, &contents, slots[5])?;
    for pool in pools(&mut cache) {
        assert_eq!(pool.get_seqlen_offset(slots[5]), 0);
    }

    let ninth = cache.allocate_seq().expect("a slot after growing");
    let contents = fill_pools(&mut cache)?;
    for pool in pools(&mut cache) {
        pool.set_seqlen_offset(ninth, 7);
    }
    cache.reset_seq(ninth)?;
    check_slot_zeroed(&mut cache, &contents, ninth)?;
    for pool in pools(&mut cache) {
        assert_eq!(pool.get_seqlen_offset(ninth), 0);
    }
    Ok(())
}
