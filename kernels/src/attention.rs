//! Causal grouped-query attention over a prompt (spec 3.5 step 4), the
//! operation the full-attention layers run between the rotary embedding and
//! the output gate.

use candle_core::{DType, Tensor};

use crate::{
    ensure, expect_dim, expect_on_device, expect_positive, expect_same_dtype, expect_shape,
    float_dims, round_to_dtype, tensor_from_f32, to_f32_vec, Result,
};

const OP: &str = "causal_attention";

/// Causal grouped-query attention of `T` queries, the last `T` positions of
/// a sequence of `L` keys:
///
/// ```text
/// s[i, j] = round(round(q_i . k_j) * scale)       j <= L - T + i
/// p[i, :] = round(softmax_f32(s[i, :]))            over the allowed j only
/// o[i]    = round(sum_j p[i, j] v_j)               (f32 accumulation)
/// ```
///
/// where `round` rounds to the dtype of `q`, and query head `h` reads
/// key/value head `h / (Hq / Hkv)`. These are the rounding points of the
/// plugin's eager attention (a matmul in the input dtype, a scaling in the
/// input dtype, an additive causal mask, the softmax in f32 rounded back,
/// the matmul with `v`), so the CPU implementation is its oracle. `scale`
/// is used as an `f32`, rounded to `f16` first for `f16` inputs (candle's
/// scaling of an `f16` tensor does so); in `bf16` the product is computed in
/// f32 and rounded once (the plugin's widened CPU scaling).
///
/// * `q`: `[B, Hq, T, D]`, any layout.
/// * `k`, `v`: `[B, Hkv, L, D]` in the dtype of `q`, with `Hq % Hkv == 0`
///   and `L >= T`.
/// * `softmax_scale`: the factor of the scores, usually `1 / sqrt(D)`;
///   finite.
///
/// On CUDA `q`, `k` and `v` are read in place when their last dimension is
/// contiguous and every other stride (batch, head, position) and the first
/// element's offset are multiples of 8 elements (16 bytes), e.g. the
/// token-major view `x.transpose(1, 2)` of a projection's `[B, T, H, D]` or
/// views of a larger key/value cache narrowed along `L`; other layouts are
/// copied to contiguous tensors first.
///
/// Returns `[B, Hq, T, D]` in the dtype of `q`: contiguous on the CPU; on
/// CUDA a view of token-major storage (`[B, T, Hq, D]` contiguous), so its
/// `transpose(1, 2)` is contiguous.
///
/// On CUDA, `bf16` and `f16` inputs with `D` of 64, 128 or 256 run a tiled
/// FlashAttention-2-style kernel on tensor cores (`mma.sync` m16n8k16, f32
/// accumulation, online softmax in f32, no materialised scores): its scores
/// are not rounded to the input dtype and its sums run in another order, so
/// it agrees with the CPU within the rounding of the output dtype, not bit
/// for bit. Other CUDA inputs (`f32`, other head dims) run a simple scalar
/// kernel with the same online softmax in f32, for any `D` up to 512.
pub fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor, softmax_scale: f32) -> Result<Tensor> {
    let args = CausalAttentionArgs::validate(q, k, v, softmax_scale)?;
    on_device!(OP, q.device(), args.cpu(), args.cuda())
}

/// The validated arguments of a [`causal_attention`] call and its sizes: `q`
/// `[batch, heads, queries, head_dim]`, `k` and `v`
/// `[batch, kv_heads, keys, head_dim]`.
pub(crate) struct CausalAttentionArgs<'a> {
    pub q: &'a Tensor,
    pub k: &'a Tensor,
    pub v: &'a Tensor,
    pub softmax_scale: f32,
    pub batch: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub queries: usize,
    pub keys: usize,
    pub head_dim: usize,
}

impl<'a> CausalAttentionArgs<'a> {
    /// Checks the arguments of a [`causal_attention`] call and reads its
    /// sizes.
    fn validate(q: &'a Tensor, k: &'a Tensor, v: &'a Tensor, softmax_scale: f32) -> Result<Self> {
        let [batch, heads, queries, head_dim] = float_dims::<4>(OP, "q", q)?;
        let k_dims = float_dims::<4>(OP, "k", k)?;
        let v_dims = float_dims::<4>(OP, "v", v)?;
        let [k_batch, kv_heads, keys, k_head_dim] = k_dims;
        expect_positive(OP, "q", "the batch size", batch)?;
        expect_positive(OP, "q", "the number of query heads", heads)?;
        expect_positive(OP, "q", "the number of queries", queries)?;
        expect_positive(OP, "q", "the head dim", head_dim)?;
        expect_dim(OP, "k", "the batch size", k_batch, batch)?;
        expect_dim(OP, "k", "the head dim", k_head_dim, head_dim)?;
        expect_positive(OP, "k", "the number of key/value heads", kv_heads)?;
        ensure(heads % kv_heads == 0, OP, "k", || {
            format!("the {heads} query heads are not a multiple of the {kv_heads} key/value heads")
        })?;
        ensure(keys >= queries, OP, "k", || {
            format!("{keys} keys are fewer than the {queries} queries")
        })?;
        expect_shape(OP, "v", &v_dims, &k_dims, "the shape of `k`")?;
        expect_same_dtype(OP, "k", k, q.dtype(), "the dtype of `q`")?;
        expect_same_dtype(OP, "v", v, q.dtype(), "the dtype of `q`")?;
        expect_on_device(OP, q.device(), [("k", k), ("v", v)])?;
        ensure(softmax_scale.is_finite(), OP, "softmax_scale", || {
            format!("{softmax_scale} is not finite")
        })?;
        Ok(Self {
            q,
            k,
            v,
            softmax_scale,
            batch,
            heads,
            kv_heads,
            queries,
            keys,
            head_dim,
        })
    }

    /// The CPU reference.
    fn cpu(&self) -> Result<Tensor> {
        let (batch, heads, queries) = (self.batch, self.heads, self.queries);
        let (kv_heads, keys, head_dim) = (self.kv_heads, self.keys, self.head_dim);
        let dtype = self.q.dtype();
        let groups = heads / kv_heads;
        let q = to_f32_vec(self.q)?;
        let k = to_f32_vec(self.k)?;
        let v = to_f32_vec(self.v)?;
        // Keys before the first query's position: query i sees keys
        // 0..=prefix + i.
        let prefix = keys - queries;
        let q_row = |b: usize, h: usize, i: usize| ((b * heads + h) * queries + i) * head_dim;
        let kv_row =
            |b: usize, h: usize, j: usize| ((b * kv_heads + h / groups) * keys + j) * head_dim;
        let score_row = |b: usize, h: usize, i: usize| ((b * heads + h) * queries + i) * keys;
        // Every query (batch b, head h, position i), in the order of `q`.
        let each_query = || {
            (0..batch).flat_map(move |b| {
                (0..heads).flat_map(move |h| (0..queries).map(move |i| (b, h, i)))
            })
        };

        // q k^T, rounded as the matmul's output in the input dtype. Masked
        // scores stay 0 here and are skipped below.
        let mut scores = vec![0f32; batch * heads * queries * keys];
        for (b, h, i) in each_query() {
            let query = &q[q_row(b, h, i)..][..head_dim];
            let row = &mut scores[score_row(b, h, i)..][..keys];
            for (j, score) in row[..=prefix + i].iter_mut().enumerate() {
                let key = &k[kv_row(b, h, j)..][..head_dim];
                *score = query.iter().zip(key).map(|(a, b)| a * b).sum();
            }
        }
        let factor = match dtype {
            DType::F16 => round_to_dtype(vec![self.softmax_scale], dtype)?[0],
            _ => self.softmax_scale,
        };
        let scores = round_to_dtype(
            round_to_dtype(scores, dtype)?
                .into_iter()
                .map(|score| score * factor)
                .collect(),
            dtype,
        )?;

        // The softmax of each row's allowed scores in f32, as candle computes
        // it (max, exp of the differences, sequential sum, division).
        let mut probs = vec![0f32; scores.len()];
        for (row, (scores, probs)) in scores
            .chunks_exact(keys)
            .zip(probs.chunks_exact_mut(keys))
            .enumerate()
        {
            let allowed = prefix + row % queries + 1;
            let max = scores[..allowed]
                .iter()
                .fold(f32::NEG_INFINITY, |m, &s| m.max(s));
            let mut sum = 0f32;
            for (p, &s) in probs[..allowed].iter_mut().zip(scores) {
                *p = (s - max).exp();
                sum += *p;
            }
            probs[..allowed].iter_mut().for_each(|p| *p /= sum);
        }
        let probs = round_to_dtype(probs, dtype)?;

        let mut out = vec![0f32; batch * heads * queries * head_dim];
        for (b, h, i) in each_query() {
            let row = &probs[score_row(b, h, i)..][..keys];
            let acc = &mut out[q_row(b, h, i)..][..head_dim];
            for (j, &p) in row[..=prefix + i].iter().enumerate() {
                let value = &v[kv_row(b, h, j)..][..head_dim];
                acc.iter_mut().zip(value).for_each(|(o, &x)| *o += p * x);
            }
        }
        tensor_from_f32(out, &[batch, heads, queries, head_dim], dtype)
    }
}
