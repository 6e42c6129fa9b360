//! Reading tensors from the checkpoint with errors that name the tensor.

use std::collections::HashMap;

use candle_core::{DType, Device, Shape, Tensor};
use mistralrs_quant::{ShardedSafeTensors, ShardedVarBuilder};

use crate::error::{BerryLmError, Result};

/// A view of the checkpoint below a name prefix.
#[derive(Clone)]
pub struct Weights {
    vb: ShardedVarBuilder,
    /// Whether the host fills, after loading, the projections this checkpoint
    /// withholds (loading from UQFF: the quantized projections are in the UQFF
    /// file, not in the checkpoint).
    host_fills_withheld: bool,
}

impl Weights {
    pub fn new(vb: ShardedVarBuilder) -> Weights {
        Weights {
            vb,
            host_fills_withheld: false,
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
        }
    }

    pub fn pp(&self, name: impl ToString) -> Weights {
        Weights {
            vb: self.vb.pp(name),
            host_fills_withheld: self.host_fills_withheld,
        }
    }

    /// The same weights read onto the CPU.
    pub fn on_cpu(&self) -> Weights {
        Weights {
            vb: self.vb.clone().set_device(Device::Cpu),
            host_fills_withheld: self.host_fills_withheld,
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

    /// The tensor `name` if the checkpoint has it.
    pub fn get_optional(&self, shape: impl Into<Shape>, name: &str) -> Result<Option<Tensor>> {
        if self.contains(name) {
            self.get(shape, name).map(Some)
        } else {
            Ok(None)
        }
    }
}
