//! `kda_core_in_pool` on CUDA: the fused decode kernel (T = 1, dv = 128,
//! dk <= 128) against the CPU reference, and against the CUDA kernels it
//! fuses (`kda_gate`, `kda_beta`, `kda_recurrence_in_pool_with`,
//! `gated_rms_norm`) called one after another: bit for bit where the
//! recurrence runs its one-block-per-head decode kernel (B * Hv >= 128);
//! prompts and other head sizes run those kernels themselves, compared with
//! the CPU reference.

use berrylm_kernels::{
    contiguous, gated_rms_norm, kda_beta, kda_core_in_pool, kda_gate, kda_recurrence_in_pool_with,
    KdaCoreInputs, KdaCoreParams, KdaPrefillAlgorithm, Result, StatePool, PAD_SLOT,
};
use candle_core::{DType, Device, Tensor};

use super::{
    compare, compare_pool_rows, gpu, identical, model, output_tol, random, scattered_slots, to_gpu,
    with_pad_rows, RecSizes, POOL_ROWS, TIGHT,
};
use crate::common::{pool_rows, Rng};

/// The recurrence's algorithm as the plugin picks it: f32 token by token
/// (exact), other dtypes by length (the chunked TF32 kernels from 64 tokens).
fn algorithm(seq_len: usize, dtype: DType) -> KdaPrefillAlgorithm {
    if dtype == DType::F32 {
        KdaPrefillAlgorithm::Sequential
    } else {
        KdaPrefillAlgorithm::for_len(seq_len)
    }
}

/// The tensors of one call, on one device: the conv's q, k, v, the
/// projections (b and z read as views of a wider stacked output, as the
/// plugin passes them), the layer's parameters and a pool of states.
struct Case {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    raw_gate: Tensor,
    projected: Tensor,
    a_log: Tensor,
    dt_bias: Tensor,
    norm_weight: Tensor,
    pool: Tensor,
    /// `[Hv * dv, Hv]`: where z and b start in `projected`'s rows.
    offsets: [usize; 2],
    widths: [usize; 2],
}

impl Case {
    fn new(rng: &mut Rng, s: &RecSizes, dtype: DType) -> Result<Case> {
        let (b, t) = (s.batch, s.seq_len);
        let z_width = s.hv * s.dv;
        // z, then b, then 5 columns of another projection.
        let projected_width = z_width + s.hv + 5;
        Ok(Case {
            q: random(rng, &[b, t, s.hk, s.dk], -1.0, 1.0, dtype)?,
            k: random(rng, &[b, t, s.hk, s.dk], -1.0, 1.0, dtype)?,
            v: random(rng, &[b, t, s.hv, s.dv], -1.0, 1.0, dtype)?,
            raw_gate: random(rng, &[b, t, s.hv * s.dk], -4.0, 4.0, dtype)?,
            projected: random(rng, &[b, t, projected_width], -3.0, 3.0, dtype)?,
            a_log: random(rng, &[s.hv], -2.0, 1.0, DType::F32)?,
            dt_bias: random(rng, &[s.hv * s.dk], -1.0, 1.0, DType::F32)?,
            norm_weight: random(rng, &[s.dv], 0.5, 1.5, DType::F32)?,
            pool: random(rng, &[POOL_ROWS, s.hv, s.dk, s.dv], -0.5, 0.5, DType::F32)?,
            offsets: [0, z_width],
            widths: [z_width, s.hv],
        })
    }

    fn to_gpu(&self) -> Result<Case> {
        let dev = gpu();
        Ok(Case {
            q: to_gpu(&self.q, &dev)?,
            k: to_gpu(&self.k, &dev)?,
            v: to_gpu(&self.v, &dev)?,
            raw_gate: to_gpu(&self.raw_gate, &dev)?,
            projected: to_gpu(&self.projected, &dev)?,
            a_log: to_gpu(&self.a_log, &dev)?,
            dt_bias: to_gpu(&self.dt_bias, &dev)?,
            norm_weight: to_gpu(&self.norm_weight, &dev)?,
            pool: to_gpu(&self.pool, &dev)?,
            ..*self
        })
    }

    /// z and b: views of `projected`.
    fn z_and_b(&self) -> Result<[Tensor; 2]> {
        let view = |i: usize| self.projected.narrow(2, self.offsets[i], self.widths[i]);
        Ok([view(0)?, view(1)?])
    }

    fn params(&self, lower_bound: Option<f32>) -> KdaCoreParams<'_> {
        KdaCoreParams {
            a_log: &self.a_log,
            dt_bias: &self.dt_bias,
            gate_lower_bound: lower_bound,
            norm_weight: &self.norm_weight,
            norm_eps: 1e-6,
        }
    }

    /// `kda_core_in_pool` at `slots`.
    fn run(&self, slots: &[u32], lower_bound: Option<f32>, dtype: DType) -> Result<Tensor> {
        let [z, b] = self.z_and_b()?;
        let inputs = KdaCoreInputs {
            q: &self.q,
            k: &self.k,
            v: &self.v,
            raw_gate: &self.raw_gate,
            b: &b,
            z: &z,
        };
        let pool = StatePool {
            states: &self.pool,
            slots: &Tensor::new(slots, self.pool.device())?,
            host_slots: slots,
        };
        let algorithm = algorithm(self.q.dim(1)?, dtype);
        kda_core_in_pool(algorithm, &inputs, &self.params(lower_bound), pool, dtype)
    }

    /// The fused operations called one by one, at `slots`.
    fn run_unfused(&self, slots: &[u32], lower_bound: Option<f32>, dtype: DType) -> Result<Tensor> {
        let [batch, seq_len, hv, dv] = *self.v.dims() else {
            unreachable!()
        };
        let dk = self.q.dim(3)?;
        let [z, b] = self.z_and_b()?;
        let gate = kda_gate(
            &self.raw_gate.reshape((batch * seq_len, hv * dk))?,
            &self.a_log,
            &self.dt_bias,
            hv,
            lower_bound,
        )?
        .reshape((batch, seq_len, hv, dk))?;
        let pool = StatePool {
            states: &self.pool,
            slots: &Tensor::new(slots, self.pool.device())?,
            host_slots: slots,
        };
        let out = kda_recurrence_in_pool_with(
            algorithm(seq_len, dtype),
            &self.q,
            &self.k,
            &self.v,
            &gate,
            &kda_beta(&b)?,
            pool,
        )?;
        let rows = batch * seq_len * hv;
        let normed = gated_rms_norm(
            &out.reshape((rows, dv))?,
            &contiguous(&z)?.reshape((rows, dv))?,
            &self.norm_weight,
            1e-6,
            dtype,
        )?;
        Ok(normed.reshape((batch, seq_len, hv * dv))?)
    }
}

/// `pool`'s values in a view that starts `offset` elements into a larger
/// buffer (contiguous, on the same device).
fn offset_view(pool: &Tensor, offset: usize) -> Result<Tensor> {
    let flat = pool.flatten_all()?;
    let padding = Tensor::zeros(offset, pool.dtype(), pool.device())?;
    let buffer = Tensor::cat(&[&padding, &flat], 0)?;
    Ok(buffer
        .narrow(0, offset, flat.elem_count())?
        .reshape(pool.dims())?)
}

/// One call on the CPU, on CUDA through `kda_core_in_pool`, and on CUDA
/// through the separate kernels, from the same pool: the CUDA output within
/// a rounding step of `dtype` of the CPU's (f32: agreement up to summation
/// order), the state rows at `slots` within `TIGHT`, every other row
/// untouched; with `bitwise`, the two CUDA runs identical (output and rows).
/// With `unaligned`, the CUDA pools start one element into their buffers, so
/// that their rows are not 16-byte aligned.
fn check(
    seed: u64,
    s: RecSizes,
    dtype: DType,
    pad: bool,
    lower_bound: Option<f32>,
    unaligned: bool,
) -> Result<()> {
    let mut rng = Rng::new(seed);
    let mut slots = scattered_slots(&mut rng, s.batch, POOL_ROWS);
    if pad {
        slots = with_pad_rows(slots);
    }
    let real: Vec<u32> = slots.iter().copied().filter(|&s| s != PAD_SLOT).collect();
    let cpu = Case::new(&mut rng, &s, dtype)?;
    let before = cpu.pool.copy()?;
    let mut fused = cpu.to_gpu()?;
    let mut unfused = cpu.to_gpu()?;
    if unaligned {
        fused.pool = offset_view(&fused.pool, 1)?;
        unfused.pool = offset_view(&unfused.pool, 1)?;
    }
    let what = format!(
        "kda_core_in_pool B={} T={} dk={} dv={} {dtype:?} pad={pad} lower bound {lower_bound:?} unaligned={unaligned}",
        s.batch, s.seq_len, s.dk, s.dv
    );

    let out_cpu = cpu.run(&slots, lower_bound, dtype)?;
    let out_fused = fused.run(&slots, lower_bound, dtype)?;
    let out_unfused = unfused.run_unfused(&slots, lower_bound, dtype)?;

    compare(
        &format!("{what} output"),
        &out_fused,
        &out_cpu,
        output_tol(dtype),
    )?;
    compare_pool_rows(&what, &fused.pool, &cpu.pool, &before, &real, TIGHT)?;
    let bitwise = s.seq_len == 1 && s.batch * s.hv >= 128;
    if bitwise {
        identical(
            &format!("{what} output vs the separate kernels"),
            &out_fused,
            &out_unfused.to_device(&Device::Cpu)?,
        )?;
        identical(
            &format!("{what} state rows vs the separate kernels"),
            &pool_rows(&fused.pool, &real)?,
            &pool_rows(&unfused.pool.to_device(&Device::Cpu)?, &real)?,
        )?;
    }
    Ok(())
}

/// Decode at BerryLM-OS's heads: the fused kernel, at B = 1 (against the
/// CPU only: the recurrence alone runs its tiled kernel there), 4 and 64
/// (also bit for bit against the separate kernels), with pad rows at B = 64
/// and the gate's lower bound at B = 4.
#[test]
fn kda_core_decode_matches_cpu_and_the_separate_kernels() -> Result<()> {
    for (i, dtype) in [DType::F32, DType::BF16, DType::F16]
        .into_iter()
        .enumerate()
    {
        let seed = 1200 + 10 * i as u64;
        check(seed, model(1, 1), dtype, false, None, false)?;
        check(seed + 1, model(4, 1), dtype, false, Some(-0.5), false)?;
        check(seed + 2, model(64, 1), dtype, true, None, false)?;
    }
    Ok(())
}

/// Prompts (the separate kernels, token by token: at T = 3 in bf16 and at
/// T = 64 in f32, as the plugin runs an f32 model), a decode at head sizes
/// the fused kernel does not take (dv = 33, dk = 65) and one on an unaligned
/// pool, against the CPU.
#[test]
fn kda_core_prompts_and_other_heads_match_cpu() -> Result<()> {
    check(1250, model(2, 3), DType::BF16, true, None, false)?;
    check(1251, model(1, 64), DType::F32, false, None, false)?;
    let odd = RecSizes {
        batch: 5,
        seq_len: 1,
        hk: 3,
        hv: 3,
        dk: 65,
        dv: 33,
    };
    check(1252, odd, DType::F32, false, Some(-1.0), false)?;
    // A decode step on a pool whose rows are not 16-byte aligned: the
    // separate kernels (the recurrence's tiled one), not the fused kernel.
    check(1253, model(8, 1), DType::BF16, true, None, true)
}
