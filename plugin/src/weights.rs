//! Reading tensors from the checkpoint with errors that name the tensor.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use candle_core::{DType, Device, Shape, Tensor};
use mistralrs_quant::{LoraAdapter, ShardedSafeTensors, ShardedVarBuilder};
use regex::Regex;

use crate::error::{BerryLmError, Result};

/// A view of the checkpoint below a name prefix.
#[derive(Clone)]
pub struct Weights {
    vb: ShardedVarBuilder,
    /// Whether the host fills, after loading, the projections this checkpoint
    /// withholds (loading from UQFF: the quantized projections are in the UQFF
    /// file, not in the checkpoint).
    host_fills_withheld: bool,
    /// The host's LoRA adapters as this load merges them, shared by every
    /// view of it.
    lora: Arc<LoraMerging>,
}

/// What every view of a load shares of its LoRA merging.
#[derive(Default)]
struct LoraMerging {
    /// Each adapter's `target_modules` as one regex (their alternation),
    /// compiled at the first projection, or why one does not compile.
    targets: OnceLock<std::result::Result<Vec<Regex>, String>>,
    /// Projections with an adapter merged in.
    merges: AtomicUsize,
}

impl LoraMerging {
    /// The target regex of each of `adapters` (the load's adapters, the same
    /// list at every call), in their order.
    fn targets(&self, adapters: &[LoraAdapter]) -> std::result::Result<&[Regex], &str> {
        let compiled = self.targets.get_or_init(|| {
            adapters
                .iter()
                .map(|adapter| {
                    let targets = adapter
                        .config
                        .target_modules
                        .iter()
                        .map(String::as_str)
                        .collect::<Vec<_>>()
                        .join("|");
                    Regex::new(&targets)
                        .map_err(|error| format!("target_modules `{targets}`: {error}"))
                })
                .collect()
        });
        compiled.as_deref().map_err(String::as_str)
    }
}

impl Weights {
    pub fn new(vb: ShardedVarBuilder) -> Weights {
        Weights {
            vb,
            host_fills_withheld: false,
            lora: Arc::default(),
        }
    }

    /// These weights, the host filling after loading the projections the
    /// checkpoint withholds when `host_fills_withheld`.
    pub fn with_host_filling_withheld(self, host_fills_withheld: bool) -> Weights {
        Weights {
            host_fills_withheld,
            ..self
        }
    }

    /// `tensors` (named relative to this prefix) read as a checkpoint under the
    /// same prefix, dtype and device as these weights.
    pub fn from_tensors(&self, tensors: HashMap<String, Tensor>) -> Weights {
        let prefix = self.vb.prefix();
        let named = tensors
            .into_iter()
            .map(|(name, tensor)| (self.full_name(&name), tensor))
            .collect::<HashMap<_, _>>();
        let root = ShardedSafeTensors::wrap(Box::new(named), self.dtype(), self.device().clone());
        Weights {
            vb: if prefix.is_empty() {
                root
            } else {
                root.pp(prefix)
            },
            host_fills_withheld: self.host_fills_withheld,
            lora: self.lora.clone(),
        }
    }

    pub fn pp(&self, name: impl ToString) -> Weights {
        Weights {
            vb: self.vb.pp(name),
            host_fills_withheld: self.host_fills_withheld,
            lora: self.lora.clone(),
        }
    }

    /// The same weights read onto the CPU.
    pub fn on_cpu(&self) -> Weights {
        Weights {
            vb: self.vb.clone().set_device(Device::Cpu),
            host_fills_withheld: self.host_fills_withheld,
            lora: self.lora.clone(),
        }
    }

    /// The host's view of these weights (the prefix its ISQ predicates match).
    pub fn var_builder(&self) -> &ShardedVarBuilder {
        &self.vb
    }

    /// Whether the host quantizes some of this load's projections: while
    /// loading (`--isq`, its predicates then set), or after it (UQFF).
    pub fn host_quantizes(&self) -> bool {
        self.host_fills_withheld || mistralrs_quant::get_immediate_isq().is_some()
    }

    /// Whether the checkpoint withholds `name` for the host to fill after loading.
    pub fn withheld(&self, name: &str) -> bool {
        self.host_fills_withheld && !self.contains(name)
    }

    pub fn full_name(&self, name: &str) -> String {
        let prefix = self.vb.prefix();
        if prefix.is_empty() {
            name.to_string()
        } else {
            format!("{prefix}.{name}")
        }
    }

    pub fn contains(&self, name: &str) -> bool {
        self.vb.contains_tensor(name)
    }

    pub fn dtype(&self) -> DType {
        self.vb.dtype()
    }

    pub fn device(&self) -> &Device {
        self.vb.device()
    }

    /// The tensor `name` with exactly `shape`, in the model's dtype.
    pub fn get(&self, shape: impl Into<Shape>, name: &str) -> Result<Tensor> {
        let shape = shape.into();
        if !self.contains(name) {
            return Err(BerryLmError::Weight {
                name: self.full_name(name),
                message: format!(
                    "missing from the checkpoint (expected shape {:?})",
                    shape.dims()
                ),
            });
        }
        self.vb
            .get(shape.clone(), name)
            .map_err(|error| BerryLmError::Weight {
                name: self.full_name(name),
                message: match error {
                    candle_core::Error::UnexpectedShape { got, .. } => {
                        format!("has shape {:?}, expected {:?}", got.dims(), shape.dims())
                    }
                    other => other.to_string(),
                },
            })
    }

    /// This module's projection weight `[out_dim, in_dim]` with the host's
    /// LoRA adapters (`--lora`) merged in, as the host merges them into its
    /// own linear layers while loading: `W + (alpha / r) B A` for each
    /// adapter whose `target_modules` (a regex of their alternation) match
    /// the module's name, its `lora_A` `[r, in_dim]` and `lora_B`
    /// `[out_dim, r]` read under that name or under PEFT's
    /// `base_model.model.` before it (a module the adapter holds neither for
    /// is left as it is). The sum is taken in f32 and rounded to the weight's
    /// dtype once.
    pub fn projection_weight(&self, out_dim: usize, in_dim: usize) -> Result<Tensor> {
        let weight = self.get((out_dim, in_dim), "weight")?;
        let module = self.vb.prefix();
        let lora_error = |message: String| BerryLmError::Lora {
            module: module.clone(),
            message,
        };
        let adapters = mistralrs_quant::get_applied_loras();
        if adapters.is_empty() {
            return Ok(weight);
        }
        let targets = self
            .lora
            .targets(&adapters)
            .map_err(|message| lora_error(message.to_string()))?;
        let mut merged: Option<Tensor> = None;
        for (adapter, pattern) in adapters.iter().zip(targets) {
            if !pattern.is_match(&module) {
                continue;
            }
            let peft = adapter.weights.pp("base_model.model").pp(&module);
            let plain = adapter.weights.pp(&module);
            let tensors = if peft.contains_tensor("lora_A.weight") {
                peft
            } else if plain.contains_tensor("lora_A.weight") {
                plain
            } else {
                // A module the adapter did not adapt: the routed experts
                // BerryLM reads one by one from their stacked tensors.
                continue;
            };
            let rank = adapter.config.rank;
            let read = |shape: (usize, usize), name: &str| {
                tensors
                    .get(shape, name)
                    .and_then(|tensor| tensor.to_device(weight.device())?.to_dtype(DType::F32))
                    .map_err(|error| lora_error(format!("{name}: {error}")))
            };
            let a = read((rank, in_dim), "lora_A.weight")?;
            let b = read((out_dim, rank), "lora_B.weight")?;
            let scale = if rank > 0 {
                adapter.config.alpha / rank as f64
            } else {
                1.0
            };
            let base = match merged.take() {
                Some(sum) => sum,
                None => weight.to_dtype(DType::F32)?,
            };
            merged = Some((base + (b.matmul(&a)? * scale)?)?);
        }
        match merged {
            Some(sum) => {
                self.lora.merges.fetch_add(1, Ordering::Relaxed);
                Ok(sum.to_dtype(weight.dtype())?)
            }
            None => Ok(weight),
        }
    }

    /// How many projections of this load have a LoRA adapter merged in.
    pub fn lora_merges(&self) -> usize {
        self.lora.merges.load(Ordering::Relaxed)
    }

    /// The tensor `name` if the checkpoint has it.
    pub fn get_optional(&self, shape: impl Into<Shape>, name: &str) -> Result<Option<Tensor>> {
        if self.contains(name) {
            self.get(shape, name).map(Some)
        } else {
            Ok(None)
        }
    }
}
