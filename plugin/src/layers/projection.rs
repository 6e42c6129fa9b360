//! BerryLM's projections (`y = x W^T (+ b)`, one per checkpoint tensor
//! `{name}.weight`) as the host's in-situ quantization (ISQ) sees them.
//!
//! A projection is held in one of two ways:
//! * in full precision by BerryLM (a [`Linear`]: its exact matmul and the
//!   CUDA GEMV), always for the projections the reference implementations
//!   never quantize (the router, the shared expert's gate, KDA's `in_proj_b`,
//!   `f_down_proj` and `f_up_proj`) and for the others when the host
//!   quantizes none of them in this load;
//! * as a layer of the host's quantization machinery
//!   (`Arc<dyn QuantMethod>`, a [`HostLayer`]) when the host quantizes it
//!   while loading (its ISQ predicates match the name, `--isq`) or fills it
//!   after loading (the checkpoint withholds it: a UQFF file holds it).
//!   `IsqModel::get_layers` lists exactly these.
//!
//! Projections of one input form a [`Projections`] group: each run of
//! adjacent full-precision projections is stacked into one matmul (their
//! weights' rows in order), and so is each run of adjacent host layers (one
//! host layer quantized from their stacked rows: attention's `q|k|v`, KDA's
//! `in_proj_qkv|in_proj_z`, the shared expert's `gate|up`), so a group
//! computes in as few launches as its kinds allow and its parts are views of
//! those outputs. (Under the GGUF types a row is quantized on its own, so the
//! stacked layer holds exactly the rows of the projections quantized alone.)

use std::ops::Range;
use std::sync::Arc;

use candle_core::quantized::QTensor;
use candle_core::{DType, Module, Result, Tensor, D};
use mistralrs_quant::{DummyLayer, QuantMethod, QuantMethodConfig, UnquantLinear};

use crate::error::BerryLmError;
use crate::layers::linear::Linear;
use crate::layers::norm::OffsetRmsNorm;
use crate::quantization;
use crate::weights::Weights;

/// One projection of a group: its checkpoint name (relative to the group's
/// weights), its shape and whether the host may quantize it.
#[derive(Debug, Clone, Copy)]
pub struct ProjectionSpec<'a> {
    pub name: &'a str,
    pub in_dim: usize,
    pub out_dim: usize,
    pub bias: bool,
    /// Whether the host may quantize it (the reference implementations keep
    /// routers and gates in full precision).
    pub quantizable: bool,
}

impl<'a> ProjectionSpec<'a> {
    /// A projection the host may quantize, without a bias.
    pub fn quantizable(name: &'a str, in_dim: usize, out_dim: usize) -> ProjectionSpec<'a> {
        ProjectionSpec {
            name,
            in_dim,
            out_dim,
            bias: false,
            quantizable: true,
        }
    }

    /// A projection kept in full precision, without a bias.
    pub fn full_precision(name: &'a str, in_dim: usize, out_dim: usize) -> ProjectionSpec<'a> {
        ProjectionSpec {
            quantizable: false,
            ..ProjectionSpec::quantizable(name, in_dim, out_dim)
        }
    }

    pub fn with_bias(self, bias: bool) -> ProjectionSpec<'a> {
        ProjectionSpec { bias, ..self }
    }
}

/// What a host layer holds once loading is over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostLayerState {
    /// Quantized; its weights take this many bytes (their UQFF serialization).
    Quantized { bytes: usize },
    /// Still in full precision (no ISQ type applied to it).
    FullPrecision,
    /// Withheld by the checkpoint, to be filled by the host from a UQFF file.
    Withheld,
}

/// A projection held by the host's quantization machinery.
#[derive(Debug, Clone)]
pub struct HostLayer {
    layer: Arc<dyn QuantMethod>,
    out_dim: usize,
    /// The bytes of its weights (and bias) in the model's dtype.
    full_precision_bytes: usize,
    /// The checkpoint projections it holds: 1, or for the routed experts
    /// stacked, one per expert and projection.
    projections: usize,
}

impl HostLayer {
    /// The projections `specs` of `weights` (adjacent projections of one
    /// input, all with or all without a bias; at least one) as one layer, their weights'
    /// rows stacked in order: a placeholder the host replaces when the
    /// checkpoint withholds them, else their weights given to the host's
    /// immediate ISQ (read onto the CPU first when it quantizes them, as the
    /// host's own layers are). One layer computes them all in one quantized
    /// matmul (for the GGUF types, each row quantized as on its own).
    fn load(weights: &Weights, specs: &[ProjectionSpec<'_>]) -> crate::error::Result<HostLayer> {
        let first = specs[0];
        let (in_dim, bias) = (first.in_dim, first.bias);
        let out_dim: usize = specs.iter().map(|spec| spec.out_dim).sum();
        let dtype_bytes = weights.dtype().size_in_bytes();
        let full_precision_bytes =
            (out_dim * in_dim + if bias { out_dim } else { 0 }) * dtype_bytes;
        let withheld = specs
            .iter()
            .filter(|spec| weights.pp(spec.name).withheld("weight"))
            .count();
        let module = weights.pp(first.name);
        let layer: Arc<dyn QuantMethod> = if withheld == specs.len() {
            Arc::new(DummyLayer::new(QuantMethodConfig::Dummy)?)
        } else if withheld > 0 {
            return Err(BerryLmError::Weight {
                name: weights.full_name(first.name),
                message: format!(
                    "the checkpoint withholds {withheld} of the {} projections {} (one layer of \
                     a UQFF file holds them all): all or none",
                    specs.len(),
                    specs
                        .iter()
                        .map(|spec| spec.name)
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            });
        } else {
            let quantized_at_load =
                mistralrs_quant::should_apply_immediate_isq(module.var_builder());
            let source = if quantized_at_load && !module.device().is_cpu() {
                weights.on_cpu()
            } else {
                weights.clone()
            };
            let rows = specs
                .iter()
                .map(|spec| {
                    source
                        .pp(spec.name)
                        .projection_weight(spec.out_dim, spec.in_dim)
                })
                .collect::<crate::error::Result<Vec<_>>>()?;
            let weight = Tensor::cat(&rows, 0)?;
            let bias = if bias {
                let biases = specs
                    .iter()
                    .map(|spec| source.pp(spec.name).get(spec.out_dim, "bias"))
                    .collect::<crate::error::Result<Vec<_>>>()?;
                Some(Tensor::cat(&biases, 0)?)
            } else {
                None
            };
            let unquantized: Arc<dyn QuantMethod> = Arc::new(UnquantLinear::new(
                QuantMethodConfig::Unquantized(candle_nn::Linear::new(weight, bias)),
            )?);
            mistralrs_quant::apply_immediate_isq(unquantized, module.var_builder().clone())?
        };
        Ok(HostLayer {
            layer,
            out_dim,
            full_precision_bytes,
            projections: specs.len(),
        })
    }

    /// The routed experts' projections of one kind, every expert's stacked
    /// into one `[E, out, in]` layer: `weights` holds each expert's `[out,
    /// in]` (the gate and up projections of an expert as one `[2I, H]`, or
    /// the down projection), or is `None` when the checkpoint withholds them
    /// (a UQFF file holds the layer). When the host's immediate ISQ matches
    /// the name of expert 0's projection `name` (as for its own stacked
    /// experts), they are quantized, each expert on its own thread
    /// ([`quantization::quantize_stacked`]). Run by the host's indexed
    /// kernels ([`HostLayer::gather_forward`]). `projections` counts the
    /// checkpoint projections it holds.
    pub fn stacked_experts(
        experts: &Weights,
        name: &str,
        shape: (usize, usize, usize),
        weights: Option<Vec<Tensor>>,
        projections: usize,
    ) -> crate::error::Result<HostLayer> {
        let (count, out_dim, in_dim) = shape;
        let predicate = experts.pp(0).pp(name);
        let layer: Arc<dyn QuantMethod> = match weights {
            None => Arc::new(DummyLayer::new(QuantMethodConfig::Dummy)?),
            Some(weights) => match mistralrs_quant::immediate_isq_match(predicate.var_builder()) {
                Some(isq) => {
                    let device = isq.device.unwrap_or_else(|| experts.device().clone());
                    Arc::new(quantization::quantize_stacked(&weights, isq.ty, &device)?)
                }
                None => Arc::new(UnquantLinear::new(QuantMethodConfig::Unquantized(
                    candle_nn::Linear::new(Tensor::stack(&weights, 0)?, None),
                ))?),
            },
        };
        Ok(HostLayer {
            layer,
            out_dim,
            full_precision_bytes: count * out_dim * in_dim * experts.dtype().size_in_bytes(),
            projections,
        })
    }

    /// For the stacked experts: `x` `[N, 1 or k, in]` through the expert
    /// `ids` `[N, k]` of each row -> `[N, k, out]`, in the host's indexed
    /// kernels (in the dtype they take).
    pub fn gather_forward(&self, x: &Tensor, ids: &Tensor) -> Result<Tensor> {
        self.layer.gather_forward_autocast(x, ids)
    }

    /// Its weights `[..., out, in]` in full precision, in `dtype` (for a
    /// quantized layer, dequantized on its device).
    pub fn dequantized(&self, dtype: DType) -> Result<Tensor> {
        self.layer.dequantize_w()?.to_dtype(dtype)
    }

    /// `x` `[..., in]` -> `[..., out]`: a quantized layer through BerryLM's
    /// GEMV for a decode step on CUDA (in the activation dtype, one launch)
    /// when it takes the layer's blocks, else through the host's quantized
    /// matmul (in the dtype it takes); one still in full precision through
    /// BerryLM's.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if let Some((weight, bias)) = self.layer.unquant_weight_bias() {
            return Linear::new(weight, bias).forward(x);
        }
        let mut dims = x.dims().to_vec();
        let rows = x.flatten_to(x.rank() - 2)?;
        let y = match self.kernel_blocks() {
            Some((blocks, bias)) if rows.dim(0)? <= QUANTIZED_GEMV_MAX_ROWS => {
                let y = berrylm_kernels::quantized_matmul(&rows, &blocks)?;
                match bias {
                    Some(bias) => y.broadcast_add(&bias.to_dtype(y.dtype())?)?,
                    None => y,
                }
            }
            _ => self.host_forward(&berrylm_kernels::contiguous(&rows)?)?,
        };
        if let Some(last) = dims.last_mut() {
            *last = self.out_dim;
        }
        y.reshape(dims)
    }

    /// `x` `[rows, in]` through the host's quantized matmul. candle's CPU
    /// backend has no bf16 matmul, and the host's layers without an
    /// activation dtype of their own (AFQ, FP8, F8Q8) dequantize into the
    /// activations' dtype: on the CPU they take bf16 rows widened to f32 and
    /// their output is rounded back once, as BerryLM's full-precision
    /// projections compute bf16 there (`ops`).
    fn host_forward(&self, x: &Tensor) -> Result<Tensor> {
        if x.dtype() == DType::BF16
            && x.device().is_cpu()
            && self.layer.quantized_act_type().is_none()
        {
            return self
                .layer
                .forward(&x.to_dtype(DType::F32)?)?
                .to_dtype(DType::BF16);
        }
        self.layer.forward_autocast(x)
    }

    /// The layer's weight (and bias) when the host holds it in GGUF blocks.
    pub fn gguf_blocks(&self) -> Option<(Arc<QTensor>, Option<Tensor>)> {
        self.layer.gguf_weight_bias()
    }

    /// The layer's GGUF blocks (and bias) when it holds them on CUDA in a
    /// type BerryLM's kernels for quantized weights take (q8_0, q4_K).
    pub fn kernel_blocks(&self) -> Option<(Arc<QTensor>, Option<Tensor>)> {
        self.gguf_blocks().filter(|(blocks, _)| {
            blocks.device().is_cuda() && berrylm_kernels::takes_gguf_dtype(blocks.dtype())
        })
    }

    /// The layer the host quantizes, serializes and fills.
    pub fn layer_mut(&mut self) -> &mut Arc<dyn QuantMethod> {
        &mut self.layer
    }

    pub fn full_precision_bytes(&self) -> usize {
        self.full_precision_bytes
    }

    pub fn projections(&self) -> usize {
        self.projections
    }

    /// What it holds now (waits for a quantization still running).
    pub fn state(&self) -> Result<HostLayerState> {
        if self.layer.name() == "dummy" {
            return Ok(HostLayerState::Withheld);
        }
        if self.layer.unquant_weight_bias().is_some() {
            return Ok(HostLayerState::FullPrecision);
        }
        Ok(HostLayerState::Quantized {
            bytes: self.layer.serialize()?.len(),
        })
    }
}

/// Up to this many input rows (decode steps of up to 8 sequences) a
/// quantized projection runs in BerryLM's GEMV, which streams the weights
/// once per group of 8 rows (the host's own quantized GEMV takes up to 8
/// rows too); more rows take the host's quantized matmul.
const QUANTIZED_GEMV_MAX_ROWS: usize = 8;

/// One matmul of a group: a run of full-precision projections stacked, or a
/// host layer.
#[derive(Debug, Clone)]
enum Segment {
    Stacked {
        linear: Linear,
        /// Each projection's checkpoint name and output width, in row order.
        parts: Vec<(String, usize)>,
    },
    Host {
        layer: HostLayer,
        /// Each projection's output width, in row order.
        widths: Vec<usize>,
    },
}

impl Segment {
    fn forward(&self, x: &Tensor) -> Result<SegmentOutput> {
        match self {
            Segment::Stacked { linear, parts }
                if parts.len() > 1 && rows(x) >= SPLIT_PROMPT_MIN_ROWS =>
            {
                let mut offset = 0;
                let mut outputs = Vec::with_capacity(parts.len());
                for (_, width) in parts {
                    outputs.push(linear.rows(offset, *width)?.forward(x)?);
                    offset += width;
                }
                Ok(SegmentOutput::Split(outputs))
            }
            Segment::Stacked { linear, .. } => Ok(SegmentOutput::Joint(linear.forward(x)?)),
            Segment::Host { layer, .. } => Ok(SegmentOutput::Joint(layer.forward(x)?)),
        }
    }

    fn widths(&self) -> Vec<usize> {
        match self {
            Segment::Stacked { parts, .. } => parts.iter().map(|(_, width)| *width).collect(),
            Segment::Host { widths, .. } => widths.clone(),
        }
    }
}

/// From this many input rows (prompts), stacked full-precision projections
/// are computed part by part, each into its own tensor: the kernels that
/// read a part (the conv, the norms, the routing) then take it as it is,
/// where a column slice of the stacked output would be copied first (a
/// 16384-token prompt copied 0.4 GB a KDA layer). Decode batches keep one
/// launch for the group.
const SPLIT_PROMPT_MIN_ROWS: usize = 256;

/// The rows of `x` `[..., in]`: the product of its leading dimensions.
fn rows(x: &Tensor) -> usize {
    x.dims().iter().rev().skip(1).product()
}

/// A segment's output for one input: its parts' columns side by side, or
/// each part's own tensor.
enum SegmentOutput {
    Joint(Tensor),
    Split(Vec<Tensor>),
}

/// Where a projection's output lies: its segment, its index among the
/// segment's parts and its columns in the segment's joint output.
#[derive(Debug, Clone, Copy)]
struct PartPlace {
    segment: usize,
    index: usize,
    offset: usize,
    width: usize,
}

/// Projections of one input (see the module docs).
#[derive(Debug, Clone)]
pub struct Projections {
    segments: Vec<Segment>,
    places: Vec<PartPlace>,
}

impl Projections {
    /// Loads `specs` from `weights`, each a host layer or in full precision:
    /// adjacent full-precision ones stacked into one matmul, and adjacent
    /// host layers (of the same bias) into one host layer.
    pub fn load(weights: &Weights, specs: &[ProjectionSpec<'_>]) -> crate::error::Result<Self> {
        let mut segments = Vec::new();
        let mut run: Vec<(String, Linear)> = Vec::new();
        let mut host_run: Vec<ProjectionSpec<'_>> = Vec::new();
        for spec in specs {
            let module = weights.pp(spec.name);
            let host_layer = spec.quantizable
                && (module.withheld("weight")
                    || mistralrs_quant::should_apply_immediate_isq(module.var_builder()));
            if host_layer {
                segments.extend(stacked_segment(std::mem::take(&mut run))?);
                if host_run.last().is_some_and(|last| last.bias != spec.bias) {
                    segments.push(host_segment(weights, &std::mem::take(&mut host_run))?);
                }
                host_run.push(*spec);
            } else {
                if !host_run.is_empty() {
                    segments.push(host_segment(weights, &std::mem::take(&mut host_run))?);
                }
                let linear =
                    Linear::load(weights, spec.name, spec.in_dim, spec.out_dim, spec.bias)?;
                run.push((weights.full_name(spec.name), linear));
            }
        }
        segments.extend(stacked_segment(run)?);
        if !host_run.is_empty() {
            segments.push(host_segment(weights, &host_run)?);
        }
        Ok(Projections::from_segments(segments))
    }

    /// Full-precision projections already stacked in `linear`: `parts` are
    /// their checkpoint names and output widths, in row order.
    pub fn stacked(linear: Linear, parts: Vec<(String, usize)>) -> Projections {
        Projections::from_segments(vec![Segment::Stacked { linear, parts }])
    }

    fn from_segments(segments: Vec<Segment>) -> Projections {
        let mut places = Vec::new();
        for (segment, widths) in segments.iter().map(Segment::widths).enumerate() {
            let mut offset = 0;
            for (index, width) in widths.into_iter().enumerate() {
                places.push(PartPlace {
                    segment,
                    index,
                    offset,
                    width,
                });
                offset += width;
            }
        }
        Projections { segments, places }
    }

    /// Every projection of `x` `[..., in]`.
    pub fn forward(&self, x: &Tensor) -> Result<Projected<'_>> {
        let outputs = match self.quantized_with_dense(x)? {
            Some(outputs) => outputs,
            None => self
                .segments
                .iter()
                .map(|segment| segment.forward(x))
                .collect::<Result<Vec<_>>>()?,
        };
        Ok(Projected {
            outputs,
            places: &self.places,
        })
    }

    /// The residual sum `x + delta` (`[N, in]` each), `norm` of it and
    /// every projection of the normed rows: `(sum, normed, projected)`. A
    /// decode step of one full-precision stack without a bias runs all three
    /// in one kernel (`berrylm_kernels::add_offset_rms_norm_matmul`).
    pub fn forward_residual_norm(
        &self,
        x: &Tensor,
        delta: &Tensor,
        norm: &OffsetRmsNorm,
    ) -> Result<(Tensor, Tensor, Projected<'_>)> {
        if let [Segment::Stacked { linear, .. }] = self.segments.as_slice() {
            if linear.bias().is_none() && linear.takes_decode_matmul(x) {
                let (sum, normed, y) = berrylm_kernels::add_offset_rms_norm_matmul(
                    x,
                    delta,
                    norm.scale(),
                    norm.eps(),
                    linear.weight(),
                )?;
                let projected = Projected {
                    outputs: vec![SegmentOutput::Joint(y)],
                    places: &self.places,
                };
                return Ok((sum, normed, projected));
            }
        }
        let (sum, normed) = norm.forward_residual(x, delta)?;
        let projected = self.forward(&normed)?;
        Ok((sum, normed, projected))
    }

    /// A group of quantized projections followed by full-precision ones (KDA's
    /// `q|k|v|z` then β and the forget gate's down projection, the shared
    /// expert's `gate|up` then the router and its gate, under ISQ) computed
    /// in one launch for a decode step on CUDA, as a bf16 group is: the two
    /// segments' outputs as views of one tensor. `None` when the group is not
    /// such a pair, the host layer's blocks are not the kernels' or `x` has
    /// more rows than the quantized GEMV takes.
    fn quantized_with_dense(&self, x: &Tensor) -> Result<Option<Vec<SegmentOutput>>> {
        let [Segment::Host { layer, .. }, Segment::Stacked { linear, .. }] =
            self.segments.as_slice()
        else {
            return Ok(None);
        };
        let dense = linear.weight();
        if rows(x) > QUANTIZED_GEMV_MAX_ROWS
            || linear.bias().is_some()
            || dense.dtype() != x.dtype()
        {
            return Ok(None);
        }
        let Some((blocks, None)) = layer.kernel_blocks() else {
            return Ok(None);
        };
        let flat = x.flatten_to(x.rank() - 2)?;
        let y = berrylm_kernels::quantized_matmul_with_dense(&flat, &blocks, dense)?;
        let (quantized_width, dense_width) = (layer.out_dim, linear.out_dim());
        let mut dims = x.dims().to_vec();
        if let Some(last) = dims.last_mut() {
            *last = quantized_width + dense_width;
        }
        let y = y.reshape(dims)?;
        Ok(Some(vec![
            SegmentOutput::Joint(y.narrow(D::Minus1, 0, quantized_width)?),
            SegmentOutput::Joint(y.narrow(D::Minus1, quantized_width, dense_width)?),
        ]))
    }

    /// The host layers, in order.
    pub fn host_layers_mut<'a>(&'a mut self, out: &mut Vec<&'a mut HostLayer>) {
        for segment in &mut self.segments {
            if let Segment::Host { layer, .. } = segment {
                out.push(layer);
            }
        }
    }

    /// The full-precision projections' weights (and biases) under their
    /// checkpoint names.
    pub fn full_precision_tensors(&self, out: &mut Vec<(String, Tensor)>) -> Result<()> {
        for segment in &self.segments {
            let Segment::Stacked { linear, parts } = segment else {
                continue;
            };
            let mut row = 0;
            for (name, width) in parts {
                out.push((
                    format!("{name}.weight"),
                    linear.weight().narrow(0, row, *width)?,
                ));
                if let Some(bias) = linear.bias() {
                    out.push((format!("{name}.bias"), bias.narrow(0, row, *width)?));
                }
                row += width;
            }
        }
        Ok(())
    }
}

/// Stacked projections compute a multiple of this many outputs (zero rows
/// appended): each row of their output then starts 16-byte aligned in
/// f16/bf16, and cuBLAS takes its aligned kernels. The MoE's stacked input
/// projection (router, shared expert's gate and up, its gate: 1153 outputs at
/// BerryLM-OS's size) ran cuBLAS's unaligned `align1` kernel, 0.81 ms per
/// layer of a 16384-token prompt on the H200 (docs/performance.md).
const STACKED_ROW_MULTIPLE: usize = 8;

/// A run of full-precision projections as one segment (none when the run is empty).
fn stacked_segment(run: Vec<(String, Linear)>) -> Result<Option<Segment>> {
    let linear = match run.as_slice() {
        [] => return Ok(None),
        [(_, single)] => single.clone(),
        many => Linear::stacked(
            &many
                .iter()
                .map(|(_, linear)| linear.clone())
                .collect::<Vec<_>>(),
        )?
        .with_rows_padded_to(STACKED_ROW_MULTIPLE)?,
    };
    let parts = run
        .into_iter()
        .map(|(name, linear)| (name, linear.out_dim()))
        .collect();
    Ok(Some(Segment::Stacked { linear, parts }))
}

/// Adjacent host-layer projections (at least one) as one segment.
fn host_segment(weights: &Weights, specs: &[ProjectionSpec<'_>]) -> crate::error::Result<Segment> {
    Ok(Segment::Host {
        layer: HostLayer::load(weights, specs)?,
        widths: specs.iter().map(|spec| spec.out_dim).collect(),
    })
}

/// The outputs of a [`Projections`] group for one input.
pub struct Projected<'a> {
    outputs: Vec<SegmentOutput>,
    places: &'a [PartPlace],
}

impl Projected<'_> {
    /// Projection `index`'s output (a view of its segment's joint output, or
    /// its own).
    pub fn part(&self, index: usize) -> Result<Tensor> {
        let place = self.places[index];
        match &self.outputs[place.segment] {
            SegmentOutput::Joint(output) => output.narrow(D::Minus1, place.offset, place.width),
            SegmentOutput::Split(outputs) => Ok(outputs[place.index].clone()),
        }
    }

    /// The outputs of projections `parts` side by side: a view when one
    /// matmul computed them all, else their concatenation.
    pub fn span(&self, parts: Range<usize>) -> Result<Tensor> {
        let places = &self.places[parts.clone()];
        if let [first, ..] = places {
            if let SegmentOutput::Joint(output) = &self.outputs[first.segment] {
                if places.iter().all(|place| place.segment == first.segment) {
                    let width = places.iter().map(|place| place.width).sum();
                    return output.narrow(D::Minus1, first.offset, width);
                }
            }
        }
        let outputs = parts
            .map(|index| self.part(index))
            .collect::<Result<Vec<_>>>()?;
        Tensor::cat(&outputs, D::Minus1)
    }
}

/// A single projection: a group of one.
#[derive(Debug, Clone)]
pub struct Projection(Projections);

impl Projection {
    pub fn load(weights: &Weights, spec: ProjectionSpec<'_>) -> crate::error::Result<Projection> {
        Ok(Projection(Projections::load(weights, &[spec])?))
    }

    /// A full-precision projection held in `linear`, named `name` in the checkpoint.
    pub fn full_precision(name: String, linear: Linear) -> Projection {
        let width = linear.out_dim();
        Projection(Projections::stacked(linear, vec![(name, width)]))
    }

    pub fn host_layers_mut<'a>(&'a mut self, out: &mut Vec<&'a mut HostLayer>) {
        self.0.host_layers_mut(out)
    }

    pub fn full_precision_tensors(&self, out: &mut Vec<(String, Tensor)>) -> Result<()> {
        self.0.full_precision_tensors(out)
    }

    /// Its weight `[out, in]`, when it is kept in full precision (not a host
    /// layer) and has no bias.
    pub fn full_precision_weight(&self) -> Option<&Tensor> {
        match self.0.segments.as_slice() {
            [Segment::Stacked { linear, .. }] if linear.bias().is_none() => Some(linear.weight()),
            _ => None,
        }
    }
}

impl Module for Projection {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.0.forward(x)?.part(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    fn linear(values: &[f32], rows: usize) -> Linear {
        let weight = Tensor::from_slice(values, (rows, values.len() / rows), &Device::Cpu).unwrap();
        Linear::new(weight, None)
    }

    #[test]
    fn stacked_projections_read_their_own_outputs_and_export_their_own_weights() {
        // Widths 2 and 1 (3 outputs, padded to 8) over inputs of 2.
        let a = linear(&[1.0, 0.0, 0.0, 1.0], 2);
        let b = linear(&[2.0, 3.0], 1);
        let segment = stacked_segment(vec![("a".into(), a), ("b".into(), b)])
            .unwrap()
            .unwrap();
        let projections = Projections::from_segments(vec![segment]);
        let x = Tensor::from_slice(&[5.0f32, 7.0], (1, 2), &Device::Cpu).unwrap();
        let projected = projections.forward(&x).unwrap();
        let SegmentOutput::Joint(joint) = &projected.outputs[0] else {
            panic!("one row computed part by part");
        };
        assert_eq!(joint.dims(), &[1, STACKED_ROW_MULTIPLE]);
        assert_eq!(
            projected.part(0).unwrap().to_vec2::<f32>().unwrap(),
            [[5.0, 7.0]]
        );
        assert_eq!(
            projected.part(1).unwrap().to_vec2::<f32>().unwrap(),
            [[31.0]]
        );
        assert_eq!(
            projected.span(0..2).unwrap().to_vec2::<f32>().unwrap(),
            [[5.0, 7.0, 31.0]]
        );
        let mut exported = Vec::new();
        projections.full_precision_tensors(&mut exported).unwrap();
        let shapes: Vec<(String, Vec<usize>)> = exported
            .iter()
            .map(|(name, tensor)| (name.clone(), tensor.dims().to_vec()))
            .collect();
        assert_eq!(
            shapes,
            [
                ("a.weight".to_string(), vec![2, 2]),
                ("b.weight".to_string(), vec![1, 2])
            ]
        );
        assert_eq!(exported[1].1.dtype(), DType::F32);
    }

    #[test]
    fn prompt_rows_take_each_part_as_its_own_tensor_with_the_same_values() {
        // Widths 3 and 2 over inputs of 4; a prompt of SPLIT_PROMPT_MIN_ROWS
        // rows against each part's own product x W^T.
        let (a_values, b_values): (Vec<f32>, Vec<f32>) = (
            (0..12).map(|i| i as f32 * 0.5 - 2.0).collect(),
            (0..8).map(|i| 1.0 - i as f32 * 0.25).collect(),
        );
        let segment = stacked_segment(vec![
            ("a".into(), linear(&a_values, 3)),
            ("b".into(), linear(&b_values, 2)),
        ])
        .unwrap()
        .unwrap();
        let projections = Projections::from_segments(vec![segment]);
        let rows = SPLIT_PROMPT_MIN_ROWS;
        let x_values: Vec<f32> = (0..rows * 4).map(|i| ((i % 7) as f32) - 3.0).collect();
        let x = Tensor::from_slice(&x_values, (1, rows, 4), &Device::Cpu).unwrap();
        let projected = projections.forward(&x).unwrap();
        assert!(matches!(projected.outputs[0], SegmentOutput::Split(_)));
        for (index, (values, width)) in [(&a_values, 3), (&b_values, 2)].into_iter().enumerate() {
            let weight = Tensor::from_slice(values, (width, 4), &Device::Cpu).unwrap();
            let expected = x.broadcast_matmul(&weight.t().unwrap()).unwrap();
            let part = projected.part(index).unwrap();
            assert!(part.is_contiguous());
            assert_eq!(part.dims(), &[1, rows, width]);
            assert_eq!(
                part.to_vec3::<f32>().unwrap(),
                expected.to_vec3::<f32>().unwrap()
            );
        }
        let span = projected.span(0..2).unwrap();
        assert_eq!(span.dims(), &[1, rows, 5]);
        assert_eq!(
            span.narrow(2, 3, 2).unwrap().to_vec3::<f32>().unwrap(),
            projected.part(1).unwrap().to_vec3::<f32>().unwrap()
        );
    }
}
