use berrylm_kernels::{
    add_offset_rms_norm_matmul, attn_res_mix, attn_res_mix_norm, causal_conv1d, decode_matmul,
    gated_rms_norm, kda_core_in_pool, kda_gate, kda_recurrence, kda_recurrence_in_pool_with,
    kda_recurrence_with, moe_block_decode, moe_route, offset_rms_norm, KdaCoreInputs,
    KdaCoreParams, KdaPrefillAlgorithm, MoeBlockInputs, MoeBlockWeights, Result, StatePool,
};

use crate::common::assert_rejects;
use candle_core::{DType, Device, Tensor};

fn zeros(dims: &[usize]) -> Tensor {
    Tensor::zeros(dims, DType::F32, &Device::Cpu).expect("zeros")
}

#[test]
fn kda_gate_rejects_bad_arguments() {
    let raw = zeros(&[2, 8]);
    let a_log = zeros(&[2]);
    let dt_bias = zeros(&[8]);
    let integer_raw = Tensor::zeros((2, 8), DType::U32, &Device::Cpu).expect("zeros");
    for (result, arg) in [
        (kda_gate(&raw, &a_log, &dt_bias, 3, None), "num_heads"),
        (kda_gate(&raw, &a_log, &dt_bias, 0, None), "num_heads"),
        (kda_gate(&raw, &zeros(&[4]), &dt_bias, 2, None), "a_log"),
        (kda_gate(&raw, &a_log, &zeros(&[4]), 2, None), "dt_bias"),
        (
            kda_gate(&zeros(&[2, 2, 4]), &a_log, &dt_bias, 2, None),
            "raw",
        ),
        (kda_gate(&integer_raw, &a_log, &dt_bias, 2, None), "raw"),
    ] {
        assert_rejects(result, "kda_gate", arg);
    }
}

#[test]
fn causal_conv1d_rejects_bad_arguments() {
    let x = zeros(&[2, 5, 3]);
    let weight = zeros(&[3, 4]);
    let state = zeros(&[2, 3, 4]);
    let op = "causal_conv1d";
    assert_rejects(causal_conv1d(&x, &zeros(&[4, 4]), &state), op, "weight");
    assert_rejects(
        causal_conv1d(&x, &zeros(&[3, 0]), &zeros(&[2, 3, 0])),
        op,
        "weight",
    );
    assert_rejects(causal_conv1d(&x, &weight, &zeros(&[2, 3, 3])), op, "state");
    assert_rejects(causal_conv1d(&x, &weight, &zeros(&[1, 3, 4])), op, "state");
    assert_rejects(causal_conv1d(&zeros(&[5, 3]), &weight, &state), op, "x");
}

#[test]
fn kda_recurrence_rejects_bad_arguments() {
    let (b, t, hk, hv, dk, dv) = (2, 3, 2, 4, 5, 6);
    let q = zeros(&[b, t, hk, dk]);
    let v = zeros(&[b, t, hv, dv]);
    let g = zeros(&[b, t, hv, dk]);
    let beta = zeros(&[b, t, hv]);
    let state = zeros(&[b, hv, dk, dv]);
    let op = "kda_recurrence";
    let bad_k = zeros(&[b, t, hk, dk + 1]);
    assert_rejects(kda_recurrence(&q, &bad_k, &v, &g, &beta, &state), op, "k");
    let bad_v = zeros(&[b, t, 3, dv]);
    assert_rejects(kda_recurrence(&q, &q, &bad_v, &g, &beta, &state), op, "v");
    let bad_g = zeros(&[b, t, hv, dv]);
    assert_rejects(kda_recurrence(&q, &q, &v, &bad_g, &beta, &state), op, "g");
    let bad_beta = zeros(&[b, t, hk]);
    assert_rejects(
        kda_recurrence(&q, &q, &v, &g, &bad_beta, &state),
        op,
        "beta",
    );
    let bad_state = zeros(&[b, hv, dv, dk]);
    assert_rejects(
        kda_recurrence(&q, &q, &v, &g, &beta, &bad_state),
        op,
        "state",
    );
    let short_v = zeros(&[b, t - 1, hv, dv]);
    assert_rejects(kda_recurrence(&q, &q, &short_v, &g, &beta, &state), op, "v");
    for algorithm in [
        KdaPrefillAlgorithm::Sequential,
        KdaPrefillAlgorithm::Chunked,
    ] {
        assert_rejects(
            kda_recurrence_with(algorithm, &q, &bad_k, &v, &g, &beta, &state),
            op,
            "k",
        );
    }
}

#[test]
fn kda_core_in_pool_rejects_bad_arguments() -> Result<()> {
    let (b, t, hk, hv, dk, dv, rows) = (2, 1, 2, 4, 5, 6, 3);
    let q = zeros(&[b, t, hk, dk]);
    let v = zeros(&[b, t, hv, dv]);
    let raw_gate = zeros(&[b, t, hv * dk]);
    let beta_logits = zeros(&[b, t, hv]);
    let z = zeros(&[b, t, hv * dv]);
    let a_log = zeros(&[hv]);
    let dt_bias = zeros(&[hv * dk]);
    let norm_weight = zeros(&[dv]);
    let pool = zeros(&[rows, hv, dk, dv]);
    let host = [2u32, 0];
    let slots = Tensor::new(&host, &Device::Cpu)?;
    let good = KdaCoreInputs {
        q: &q,
        k: &q,
        v: &v,
        raw_gate: &raw_gate,
        b: &beta_logits,
        z: &z,
    };
    let params = KdaCoreParams {
        a_log: &a_log,
        dt_bias: &dt_bias,
        gate_lower_bound: None,
        norm_weight: &norm_weight,
        norm_eps: 1e-6,
    };
    let run = |inputs: &KdaCoreInputs<'_>, params: &KdaCoreParams<'_>, pool: &Tensor| {
        let pool = StatePool {
            states: pool,
            slots: &slots,
            host_slots: &host,
        };
        kda_core_in_pool(
            KdaPrefillAlgorithm::Sequential,
            inputs,
            params,
            pool,
            DType::F32,
        )
    };
    let op = "kda_core_in_pool";
    // The arguments are sound: the call runs and gives [B, T, Hv * dv].
    assert_eq!(run(&good, &params, &pool)?.dims(), &[b, t, hv * dv]);
    let wrong_gate = zeros(&[b, t, hv * dk + 1]);
    let wrong_b = zeros(&[b, t, hv + 1]);
    let wrong_z = zeros(&[b, t, hv * dv - 1]);
    let wrong_v = zeros(&[b, t, 3, dv]);
    for (inputs, arg) in [
        (
            KdaCoreInputs {
                v: &wrong_v,
                ..good
            },
            "v",
        ),
        (
            KdaCoreInputs {
                raw_gate: &wrong_gate,
                ..good
            },
            "raw_gate",
        ),
        (
            KdaCoreInputs {
                b: &wrong_b,
                ..good
            },
            "b",
        ),
        (
            KdaCoreInputs {
                z: &wrong_z,
                ..good
            },
            "z",
        ),
    ] {
        assert_rejects(run(&inputs, &params, &pool), op, arg);
    }
    let wrong_a_log = zeros(&[hv + 1]);
    let wrong_dt_bias = zeros(&[hv]);
    let wrong_norm = zeros(&[dk]);
    for (params, arg) in [
        (
            KdaCoreParams {
                a_log: &wrong_a_log,
                ..params
            },
            "a_log",
        ),
        (
            KdaCoreParams {
                dt_bias: &wrong_dt_bias,
                ..params
            },
            "dt_bias",
        ),
        (
            KdaCoreParams {
                norm_weight: &wrong_norm,
                ..params
            },
            "norm_weight",
        ),
    ] {
        assert_rejects(run(&good, &params, &pool), op, arg);
    }
    assert_rejects(run(&good, &params, &zeros(&[rows, hv, dk, 4])), op, "pool");
    Ok(())
}

#[test]
fn kda_recurrence_in_pool_rejects_bad_arguments() -> Result<()> {
    let (b, t, hk, hv, dk, dv, rows) = (2, 1, 2, 4, 5, 5, 6);
    let q = zeros(&[b, t, hk, dk]);
    let v = zeros(&[b, t, hv, dv]);
    let g = zeros(&[b, t, hv, dk]);
    let beta = zeros(&[b, t, hv]);
    let pool = Tensor::ones((rows, hv, dk, dv), DType::F32, &Device::Cpu)?;
    let host = [4u32, 1];
    let slots = Tensor::new(&host, &Device::Cpu)?;
    let op = "kda_recurrence_in_pool";
    let run = |q: &Tensor, pool: &Tensor, slots: &Tensor, host: &[u32]| {
        let pool = StatePool {
            states: pool,
            slots,
            host_slots: host,
        };
        kda_recurrence_in_pool_with(KdaPrefillAlgorithm::for_len(t), q, q, &v, &g, &beta, pool)
    };
    // Token inputs: as kda_recurrence, under this op's name.
    assert_rejects(run(&zeros(&[b, t, 3, dk]), &pool, &slots, &host), op, "v");
    assert_rejects(
        kda_recurrence_in_pool_with(
            KdaPrefillAlgorithm::for_len(t),
            &q,
            &zeros(&[b, t, hk, 4]),
            &v,
            &g,
            &beta,
            StatePool {
                states: &pool,
                slots: &slots,
                host_slots: &host,
            },
        ),
        op,
        "k",
    );
    // The pool: f32, [S, Hv, dk, dv], contiguous.
    assert_rejects(
        run(&q, &pool.to_dtype(DType::BF16)?, &slots, &host),
        op,
        "pool",
    );
    assert_rejects(
        run(&q, &zeros(&[rows, hv, dk, 4]), &slots, &host),
        op,
        "pool",
    );
    assert_rejects(
        run(&q, &zeros(&[rows, hv * dk * dv]), &slots, &host),
        op,
        "pool",
    );
    assert_rejects(run(&q, &pool.transpose(2, 3)?, &slots, &host), op, "pool");
    // The slots tensor: u32 [B], equal to the host slots (on the CPU).
    assert_rejects(
        run(&q, &pool, &slots.to_dtype(DType::F32)?, &host),
        op,
        "slots",
    );
    let three = Tensor::new(&[4u32, 1, 0], &Device::Cpu)?;
    assert_rejects(run(&q, &pool, &three, &host), op, "slots");
    assert_rejects(run(&q, &pool, &slots, &[1, 4]), op, "slots");
    // The host slots: B of them, each < S, distinct.
    assert_rejects(run(&q, &pool, &slots, &[4]), op, "host_slots");
    let out_of_range = Tensor::new(&[4u32, 6], &Device::Cpu)?;
    assert_rejects(run(&q, &pool, &out_of_range, &[4, 6]), op, "host_slots");
    let duplicate = Tensor::new(&[3u32, 3], &Device::Cpu)?;
    assert_rejects(run(&q, &pool, &duplicate, &[3, 3]), op, "host_slots");
    // Nothing was written by the rejected calls.
    assert_eq!(
        pool.flatten_all()?.to_vec1::<f32>()?,
        vec![1.0; rows * hv * dk * dv]
    );
    Ok(())
}

#[test]
fn attn_res_mix_rejects_bad_arguments() {
    let x = zeros(&[3, 8]);
    let query = zeros(&[8]);
    let op = "attn_res_mix";
    assert_rejects(attn_res_mix(&[], &query, None, 1e-6), op, "sources");
    assert_rejects(
        attn_res_mix(&[zeros(&[3, 7]), x.clone()], &query, None, 1e-6),
        op,
        "sources",
    );
    assert_rejects(
        attn_res_mix(std::slice::from_ref(&x), &zeros(&[7]), None, 1e-6),
        op,
        "pseudo_query",
    );
    let op = "attn_res_mix_norm";
    let scale = zeros(&[8]);
    assert_rejects(
        attn_res_mix_norm(&[], &query, None, 1e-6, &scale, 1e-6),
        op,
        "sources",
    );
    let with_scale = |scale: &Tensor| {
        attn_res_mix_norm(std::slice::from_ref(&x), &query, None, 1e-6, scale, 1e-6)
    };
    assert_rejects(with_scale(&zeros(&[7])), op, "scale");
    let bf16_scale = scale.to_dtype(DType::BF16).expect("bf16");
    assert_rejects(with_scale(&bf16_scale), op, "scale");
}

#[test]
fn gated_rms_norm_rejects_bad_arguments() {
    let x = zeros(&[3, 8]);
    for (result, arg) in [
        (
            gated_rms_norm(&x, &zeros(&[3, 7]), &zeros(&[8]), 1e-6, DType::F32),
            "z",
        ),
        (
            gated_rms_norm(&x, &x, &zeros(&[7]), 1e-6, DType::F32),
            "weight",
        ),
        (
            gated_rms_norm(&zeros(&[8]), &x, &zeros(&[8]), 1e-6, DType::F32),
            "x",
        ),
    ] {
        assert_rejects(result, "gated_rms_norm", arg);
    }
}

#[test]
fn decode_matmul_rejects_bad_arguments() {
    let x = zeros(&[3, 8]);
    let op = "decode_matmul";
    assert_rejects(decode_matmul(&x, &zeros(&[5, 7])), op, "weight");
    assert_rejects(decode_matmul(&zeros(&[8]), &zeros(&[5, 8])), op, "x");
    let half = Tensor::zeros((5, 8), DType::BF16, &Device::Cpu).expect("zeros");
    assert_rejects(decode_matmul(&x, &half), op, "weight");
}

#[test]
fn moe_block_decode_rejects_bad_arguments() {
    // 2 tokens, 4 experts of width 3 over hidden 8, the shared expert 5 wide.
    let (x, residual) = (zeros(&[2, 8]), zeros(&[2, 8]));
    let ids = |top_k: usize| Tensor::zeros((2, top_k), DType::U32, &Device::Cpu).expect("ids");
    let (gate_up, down) = (zeros(&[4, 6, 8]), zeros(&[4, 8, 3]));
    let (shared_gate_up, shared_gate_logit) = (zeros(&[2, 10]), zeros(&[2, 1]));
    let half_logit = Tensor::zeros((2, 1), DType::BF16, &Device::Cpu).expect("zeros");
    let call = |top_k: usize,
                shared_gate_up: &Tensor,
                shared_gate_logit: &Tensor,
                shared_down: &Tensor| {
        moe_block_decode(
            &MoeBlockInputs {
                x: &x,
                residual: &residual,
                weights: &zeros(&[2, top_k]),
                ids: &ids(top_k),
                shared_gate_up,
                shared_gate_logit,
            },
            &MoeBlockWeights {
                gate_up: &gate_up,
                down: &down,
                shared_down,
            },
        )
    };
    let op = "moe_block_decode";
    let shared_down = zeros(&[8, 5]);
    let (gu, gl) = (&shared_gate_up, &shared_gate_logit);
    assert_rejects(call(9, gu, gl, &shared_down), op, "ids");
    assert_rejects(call(2, gu, gl, &zeros(&[7, 5])), op, "shared_down");
    assert_rejects(
        call(2, &zeros(&[2, 8]), gl, &shared_down),
        op,
        "shared_gate_up",
    );
    assert_rejects(
        call(2, gu, &half_logit, &shared_down),
        op,
        "shared_gate_logit",
    );
    assert!(call(2, gu, gl, &shared_down).is_ok());
}

#[test]
fn offset_rms_norm_rejects_bad_arguments() {
    let x = zeros(&[3, 8]);
    let op = "offset_rms_norm";
    assert_rejects(offset_rms_norm(&x, &zeros(&[7]), 1e-6), op, "scale");
    assert_rejects(offset_rms_norm(&x, &zeros(&[1, 8]), 1e-6), op, "scale");
    let bf16_scale = zeros(&[8]).to_dtype(DType::BF16).expect("bf16");
    assert_rejects(offset_rms_norm(&x, &bf16_scale, 1e-6), op, "scale");
    let scalar = Tensor::new(1f32, &Device::Cpu).expect("scalar");
    assert_rejects(offset_rms_norm(&scalar, &zeros(&[1]), 1e-6), op, "x");
    assert_rejects(
        offset_rms_norm(&zeros(&[3, 0]), &zeros(&[0]), 1e-6),
        op,
        "x",
    );
    let integer_x = Tensor::zeros((3, 8), DType::U32, &Device::Cpu).expect("zeros");
    assert_rejects(offset_rms_norm(&integer_x, &zeros(&[8]), 1e-6), op, "x");
}

#[test]
fn add_offset_rms_norm_matmul_rejects_bad_arguments() {
    let (x, scale, weight) = (zeros(&[3, 8]), zeros(&[8]), zeros(&[5, 8]));
    let call = |delta: &Tensor, scale: &Tensor, weight: &Tensor| {
        add_offset_rms_norm_matmul(&x, delta, scale, 1e-6, weight)
    };
    let op = "add_offset_rms_norm_matmul";
    assert_rejects(call(&x, &scale, &zeros(&[5, 7])), op, "weight");
    let half = zeros(&[5, 8]).to_dtype(DType::BF16).expect("bf16");
    assert_rejects(call(&x, &scale, &half), op, "weight");
    // The norm's own arguments, named by the norm.
    assert_rejects(
        call(&zeros(&[3, 7]), &scale, &weight),
        "offset_rms_norm",
        "delta",
    );
    assert_rejects(call(&x, &zeros(&[7]), &weight), "offset_rms_norm", "scale");
}

#[test]
fn moe_route_rejects_bad_arguments() {
    let logits = zeros(&[3, 8]);
    let op = "moe_route";
    assert_rejects(moe_route(&logits, 0, true, DType::F32), op, "top_k");
    assert_rejects(moe_route(&logits, 9, true, DType::F32), op, "top_k");
    assert_rejects(moe_route(&logits, 2, true, DType::U32), op, "weight_dtype");
    assert_rejects(
        moe_route(&zeros(&[8]), 2, true, DType::F32),
        op,
        "router_logits",
    );
    assert_rejects(
        moe_route(&zeros(&[3, 0]), 1, true, DType::F32),
        op,
        "router_logits",
    );
    let integer_logits = Tensor::zeros((3, 8), DType::U32, &Device::Cpu).expect("zeros");
    assert_rejects(
        moe_route(&integer_logits, 2, true, DType::F32),
        op,
        "router_logits",
    );
}

#[test]
fn errors_convert_to_candle_errors_with_their_message() {
    let error = kda_gate(&zeros(&[2, 8]), &zeros(&[2]), &zeros(&[8]), 3, None)
        .expect_err("3 heads do not divide 8 channels");
    let message = error.to_string();
    assert!(
        message.starts_with("kda_gate: invalid argument `num_heads`"),
        "{message}"
    );
    let candle_error: candle_core::Error = error.into();
    assert!(
        candle_error.to_string().contains("`num_heads`"),
        "{candle_error}"
    );
}
