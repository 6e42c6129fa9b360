//! A broken checkpoint fails to load with an error naming the tensor, and the
//! shapes involved, instead of panicking.

use std::collections::HashMap;

use anyhow::Result;
use berrylm::model::BerryLm;
use berrylm::weights::Weights;
use berrylm::BerryLmConfig;
use berrylm_tests::fixtures_dir;
use candle_core::{DType, Device, Tensor};
use mistralrs_quant::ShardedSafeTensors;

fn small_hybrid() -> Result<(BerryLmConfig, HashMap<String, Tensor>)> {
    let dir = fixtures_dir().join("small-hybrid/model");
    let cfg = BerryLmConfig::from_json(&std::fs::read_to_string(dir.join("config.json"))?)?;
    let tensors = candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu)?;
    Ok((cfg, tensors))
}

fn load_error(cfg: BerryLmConfig, tensors: HashMap<String, Tensor>) -> String {
    let vb = ShardedSafeTensors::wrap(Box::new(tensors), DType::F32, Device::Cpu);
    match BerryLm::load(cfg, &Weights::new(vb), false) {
        Ok(_) => panic!("a broken checkpoint loaded"),
        Err(error) => error.to_string(),
    }
}

#[test]
fn the_unbroken_tensors_load() -> Result<()> {
    let (cfg, tensors) = small_hybrid()?;
    let vb = ShardedSafeTensors::wrap(Box::new(tensors), DType::F32, Device::Cpu);
    BerryLm::load(cfg, &Weights::new(vb), false)?;
    Ok(())
}

#[test]
fn a_missing_tensor_is_named() -> Result<()> {
    let (cfg, mut tensors) = small_hybrid()?;
    let name = "model.layers.5.linear_attn.in_proj_z.weight";
    assert!(tensors.remove(name).is_some());
    let error = load_error(cfg, tensors);
    assert!(error.contains(name) && error.contains("missing"), "{error}");
    Ok(())
}

#[test]
fn a_wrong_shape_is_named_with_both_shapes() -> Result<()> {
    let (cfg, mut tensors) = small_hybrid()?;
    let name = "model.layers.3.self_attn.k_norm.weight";
    let expected = tensors[name].dims().to_vec();
    tensors.insert(
        name.to_string(),
        Tensor::zeros(7, DType::F32, &Device::Cpu)?,
    );
    let error = load_error(cfg, tensors);
    assert!(error.contains(name), "{error}");
    assert!(
        error.contains("[7]") && error.contains(&format!("{expected:?}")),
        "{error}"
    );
    Ok(())
}

#[test]
fn a_checkpoint_without_the_kda_module_names_both_layouts() -> Result<()> {
    let (cfg, mut tensors) = small_hybrid()?;
    tensors.retain(|name, _| !name.starts_with("model.layers.0.linear_attn."));
    let error = load_error(cfg, tensors);
    assert!(
        error.contains("model.layers.0.linear_attn.in_proj_qkv.weight"),
        "{error}"
    );
    assert!(
        error.contains("model.layers.0.kda.in_proj_qkv.weight"),
        "{error}"
    );
    Ok(())
}
