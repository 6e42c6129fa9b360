//! KDA linear attention: packed q|k|v short conv with state, a per-channel
//! forget gate, the gated delta rule in fp32, and a SiLU-gated output norm.

use berrylm_kernels::{KdaCoreInputs, KdaCoreParams, KdaPrefillAlgorithm, StatePool};
use candle_core::{DType, Module, Result, Tensor};

use crate::config::BerryLmConfig;
use crate::error::BerryLmError;
use crate::layers::projection::{HostLayer, Projection, ProjectionSpec, Projections};
use crate::weights::Weights;

/// One sequence group's KDA state: its rows of the host's pools, which the
/// layer reads and updates in place.
pub struct KdaState<'a> {
    /// The conv states, `[S, conv_dim, Kc]` rows: the last `Kc` pre-conv
    /// q|k|v columns of each sequence.
    pub conv: StatePool<'a>,
    /// The recurrent states, `[S, Hv, dk, dv]` rows.
    pub recurrent: StatePool<'a>,
}

pub struct Kda {
    /// The module's checkpoint name (`model.layers.0.linear_attn`).
    name: String,
    /// `in_proj_qkv`, `in_proj_z`, `in_proj_b` and `f_down_proj`, whose
    /// outputs are q|k|v, z, b and the gate's bottleneck; stacked into one
    /// projection (one launch per step instead of four) when the host
    /// quantizes none of them.
    in_proj: Projections,
    f_up_proj: Projection,
    /// `[conv_dim, Kc]`. This and the other parameters of the kernels are kept
    /// in f32 (exact), the dtype the kernels compute in, so that no call
    /// converts them.
    conv_weight: Tensor,
    a_log: Tensor,
    dt_bias: Tensor,
    norm_weight: Tensor,
    out_proj: Projection,
    num_key_heads: usize,
    num_value_heads: usize,
    key_head_dim: usize,
    value_head_dim: usize,
    gate_lower_bound: Option<f32>,
    norm_eps: f64,
}

/// Checkpoints name the KDA module `linear_attn` (transformers) or `kda` (vLLM, llama.cpp).
const MODULE_NAMES: [&str; 2] = ["linear_attn", "kda"];

impl Kda {
    pub fn load(layer: &Weights, cfg: &BerryLmConfig) -> crate::error::Result<Kda> {
        // A UQFF file's checkpoint withholds `in_proj_qkv` (quantized) but
        // holds `in_proj_b` (never quantized).
        let module_name = MODULE_NAMES
            .iter()
            .find(|name| {
                ["in_proj_qkv", "in_proj_b"]
                    .iter()
                    .any(|projection| layer.contains(&format!("{name}.{projection}.weight")))
            })
            .ok_or_else(|| BerryLmError::Weight {
                name: layer.full_name("linear_attn.in_proj_qkv.weight"),
                message: format!(
                    "missing from the checkpoint (nor found as {})",
                    layer.full_name("kda.in_proj_qkv.weight")
                ),
            })?;
        let kda = layer.pp(module_name);
        let hidden = cfg.hidden_size;
        let conv_dim = cfg.linear_conv_dim();
        let kernel = cfg.linear_conv_kernel_dim;
        let gate_dim = cfg.linear_num_value_heads * cfg.linear_key_head_dim;
        let conv_weight = kda
            .pp("conv1d")
            .get((conv_dim, 1, kernel), "weight")?
            .reshape((conv_dim, kernel))?
            .to_dtype(DType::F32)?;
        // β and the forget gate's projections stay in full precision, as in
        // the reference implementations.
        let in_proj = Projections::load(
            &kda,
            &[
                ProjectionSpec::quantizable("in_proj_qkv", hidden, conv_dim),
                ProjectionSpec::quantizable("in_proj_z", hidden, cfg.linear_value_dim()),
                ProjectionSpec::full_precision("in_proj_b", hidden, cfg.linear_num_value_heads),
                ProjectionSpec::full_precision("f_down_proj", hidden, cfg.kda_gate_bottleneck),
            ],
        )?;
        Ok(Kda {
            name: layer.full_name(module_name),
            in_proj,
            f_up_proj: Projection::load(
                &kda,
                ProjectionSpec::full_precision("f_up_proj", cfg.kda_gate_bottleneck, gate_dim),
            )?,
            conv_weight,
            a_log: kda
                .get(cfg.linear_num_value_heads, "A_log")?
                .to_dtype(DType::F32)?,
            dt_bias: kda.get(gate_dim, "dt_bias")?.to_dtype(DType::F32)?,
            norm_weight: kda
                .pp("norm")
                .get(cfg.linear_value_head_dim, "weight")?
                .to_dtype(DType::F32)?,
            out_proj: Projection::load(
                &kda,
                ProjectionSpec::quantizable("out_proj", cfg.linear_value_dim(), hidden),
            )?,
            num_key_heads: cfg.linear_num_key_heads,
            num_value_heads: cfg.linear_num_value_heads,
            key_head_dim: cfg.linear_key_head_dim,
            value_head_dim: cfg.linear_value_head_dim,
            gate_lower_bound: cfg.kda_gate_lower_bound.map(|bound| bound as f32),
            norm_eps: cfg.rms_norm_eps,
        })
    }

    /// Its projections the host quantizes or fills, in order.
    pub fn host_layers_mut<'a>(&'a mut self, out: &mut Vec<&'a mut HostLayer>) {
        self.in_proj.host_layers_mut(out);
        self.out_proj.host_layers_mut(out);
    }

    /// Its full-precision tensors under their checkpoint names, in `dtype`
    /// (the parameters kept in f32 go back exactly: they were read in it).
    pub fn checkpoint_tensors(&self, dtype: DType, out: &mut Vec<(String, Tensor)>) -> Result<()> {
        self.in_proj.full_precision_tensors(out)?;
        self.f_up_proj.full_precision_tensors(out)?;
        self.out_proj.full_precision_tensors(out)?;
        let (conv_dim, kernel) = self.conv_weight.dims2()?;
        let name = &self.name;
        out.extend([
            (
                format!("{name}.conv1d.weight"),
                self.conv_weight
                    .reshape((conv_dim, 1, kernel))?
                    .to_dtype(dtype)?,
            ),
            (format!("{name}.A_log"), self.a_log.to_dtype(dtype)?),
            (format!("{name}.dt_bias"), self.dt_bias.to_dtype(dtype)?),
            (
                format!("{name}.norm.weight"),
                self.norm_weight.to_dtype(dtype)?,
            ),
        ]);
        Ok(())
    }

    /// `x` `[B, T, hidden]` (already normed) continues the sequences whose state
    /// is `state`; returns the layer output and leaves the new states in
    /// `state`'s pool rows.
    pub fn forward(&self, x: &Tensor, state: &KdaState<'_>) -> Result<Tensor> {
        let (batch, seq_len, _) = x.dims3()?;
        let dtype = x.dtype();
        let key_dim = self.num_key_heads * self.key_head_dim;
        let value_dim = self.num_value_heads * self.value_head_dim;

        // Views of the stacked projection's columns, which the kernels below
        // read in place.
        let projected = self.in_proj.forward(x)?;
        let raw_gate = self.f_up_proj.forward(&projected.part(3)?)?;

        // The pool keeps the conv state in f32; its columns are activation
        // values, exact in f32, and the kernel reads each sequence's row and
        // writes the new state back into it in the pool's dtype. The packed
        // q|k|v come out as three tensors.
        let qkv = berrylm_kernels::causal_conv1d_split_in_pool(
            &projected.part(0)?,
            &self.conv_weight,
            state.conv,
            &[key_dim, key_dim, value_dim],
        )?;
        let [q, k, v] = <[Tensor; 3]>::try_from(qkv).map_err(|parts| {
            candle_core::Error::Msg(format!(
                "causal_conv1d_split_in_pool returned {} tensors for q, k, v",
                parts.len()
            ))
        })?;
        // A float32 model keeps f32 arithmetic in the recurrence (the exact
        // path). Lower-precision activations take the kernels' default, which
        // computes long CUDA prefills with TF32 tensor-core products, an error
        // far below their own rounding.
        let algorithm = if dtype == DType::F32 {
            KdaPrefillAlgorithm::Sequential
        } else {
            KdaPrefillAlgorithm::for_len(seq_len)
        };
        // Gate, write strength, the recurrence and the gated norm (one
        // kernel for a CUDA decode step).
        let normed = berrylm_kernels::kda_core_in_pool(
            algorithm,
            &KdaCoreInputs {
                q: &q.reshape((batch, seq_len, self.num_key_heads, self.key_head_dim))?,
                k: &k.reshape((batch, seq_len, self.num_key_heads, self.key_head_dim))?,
                v: &v.reshape((batch, seq_len, self.num_value_heads, self.value_head_dim))?,
                raw_gate: &raw_gate,
                b: &projected.part(2)?,
                z: &projected.part(1)?,
            },
            &KdaCoreParams {
                a_log: &self.a_log,
                dt_bias: &self.dt_bias,
                gate_lower_bound: self.gate_lower_bound,
                norm_weight: &self.norm_weight,
                norm_eps: self.norm_eps,
            },
            state.recurrent,
            dtype,
        )?;
        self.out_proj.forward(&normed)
    }
}
