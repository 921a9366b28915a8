//! Causal self-attention, MLP and Block: backward against central finite differences, causality,
//! names and children. Causality, the single-position closed form and the low-precision
//! comparison run on the host and on the emulated device, with the same values on both.

mod common;

use common::{check_module, host_values, random, same_on_both};
use hypershard_nn::{
    Block, BlockConfig, CausalSelfAttention, CausalSelfAttentionConfig, Mlp, Module,
    parameter_names,
};
use hypershard_tensor::{DType, Device, RandomInit, Tensor};

/// `module.forward(x)` on `device` (where the module is), read back on the host.
fn forward_values(module: &mut dyn Module, x: &Tensor, device: &Device) -> Vec<f64> {
    module
        .forward(&x.to_device(device).expect("input"))
        .map(|y| host_values(&y))
        .expect("forward")
}

fn block_config(n_embd: usize, n_head: usize, bias: bool, seed: u64) -> BlockConfig {
    BlockConfig {
        n_embd,
        n_head,
        bias,
        dropout: 0.0,
        dtype: DType::F64,
        seed,
    }
}

fn attention(n_embd: usize, n_head: usize, bias: bool, seed: u64) -> CausalSelfAttention {
    // invariant: the sizes below are valid.
    CausalSelfAttention::new(CausalSelfAttentionConfig {
        n_embd,
        n_head,
        bias,
        dropout: 0.0,
        dtype: DType::F64,
        seed,
    })
    .expect("attention")
}

#[test]
fn attention_backward_matches_finite_differences() {
    for (bias, n_head) in [(true, 2), (false, 1), (true, 3)] {
        let mut attn = attention(6, n_head, bias, 11);
        check_module(&mut attn, &[2, 4, 6], 21);
    }
}

#[test]
fn mlp_and_block_backward_match_finite_differences() {
    let mut mlp = Mlp::new(block_config(3, 1, true, 5)).expect("mlp");
    check_module(&mut mlp, &[2, 2, 3], 31);
    for bias in [true, false] {
        let mut block = Block::new(block_config(4, 2, bias, 7)).expect("block");
        check_module(&mut block, &[2, 3, 4], 41);
    }
}

#[test]
fn attention_is_causal() {
    // Changing the last position must leave every earlier output unchanged.
    let x = random(&[1, 5, 4], DType::F64, 9);
    let mut changed = x.to_vec::<f64>().expect("f64");
    for v in &mut changed[16..20] {
        *v += 1.0;
    }
    let changed = Tensor::from_vec(changed, &[1, 5, 4]).expect("tensor");
    let (before, after) = same_on_both(|d| {
        let mut attn = attention(4, 2, true, 3);
        hypershard_nn::to_device(&mut attn, d).expect("to_device");
        (
            forward_values(&mut attn, &x, d),
            forward_values(&mut attn, &changed, d),
        )
    });
    assert_eq!(&before[..16], &after[..16]);
    assert!(before[16..].iter().zip(&after[16..]).any(|(a, b)| a != b));
}

#[test]
fn single_position_attention_is_the_value_projection() {
    // With T = 1 the softmax is exactly 1, so y = c_proj(v) where v is the last third of c_attn.
    let mut weights = Vec::new();
    attention(2, 1, false, 4)
        .visit_params("", &mut |_, p| {
            weights.push(p.data()?.to_vec::<f64>()?);
            Ok(())
        })
        .expect("visit");
    let (w_attn, w_proj) = (&weights[0], &weights[1]);
    let x = [0.5f64, -1.25];
    let out = same_on_both(|d| {
        let mut attn = attention(2, 1, false, 4);
        hypershard_nn::to_device(&mut attn, d).expect("to_device");
        let input = Tensor::from_vec(x.to_vec(), &[1, 1, 2]).expect("tensor");
        forward_values(&mut attn, &input, d)
    });
    // c_attn weight is [6, 2]; rows 4 and 5 give v.
    let v: Vec<f64> = (4..6)
        .map(|r| w_attn[2 * r] * x[0] + w_attn[2 * r + 1] * x[1])
        .collect();
    for (o, expected) in out
        .iter()
        .zip((0..2).map(|r| w_proj[2 * r] * v[0] + w_proj[2 * r + 1] * v[1]))
    {
        assert!((o - expected).abs() < 1e-14, "{o} vs {expected}");
    }
}

#[test]
fn names_and_children_follow_nanogpt() {
    let mut block = Block::new(block_config(4, 2, true, 1)).expect("block");
    assert_eq!(
        parameter_names(&block).expect("names"),
        [
            "ln_1.weight",
            "ln_1.bias",
            "attn.c_attn.weight",
            "attn.c_attn.bias",
            "attn.c_proj.weight",
            "attn.c_proj.bias",
            "ln_2.weight",
            "ln_2.bias",
            "mlp.c_fc.weight",
            "mlp.c_fc.bias",
            "mlp.c_proj.weight",
            "mlp.c_proj.bias",
        ]
    );
    let mut children = Vec::new();
    block
        .visit_children_mut(&mut |name, _| {
            children.push(name.to_string());
            Ok(())
        })
        .expect("children");
    assert_eq!(children, ["ln_1", "attn", "ln_2", "mlp"]);
    let mut shapes = Vec::new();
    block
        .visit_params("", &mut |_, p| {
            shapes.push(p.data()?.shape().to_vec());
            Ok(())
        })
        .expect("visit");
    assert_eq!(shapes[2], [12, 4]);
    assert_eq!(shapes[8], [16, 4]);
    assert_eq!(shapes[10], [4, 16]);
}

#[test]
fn f32_and_bf16_attention_agree_with_f64() {
    let mut reference = attention(8, 2, true, 13);
    let x =
        Tensor::random(&[2, 6, 8], DType::F64, RandomInit::uniform(2, -1.0, 1.0)).expect("random");
    let expected = reference
        .forward(&x)
        .expect("forward")
        .to_f64_vec()
        .expect("f64");
    let g = random(&[2, 6, 8], DType::F64, 3);
    let expected_grad = reference
        .backward(&g)
        .expect("backward")
        .to_f64_vec()
        .expect("f64");
    for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 3e-2)] {
        let (y, gx) = same_on_both(|d| {
            let mut low = attention(8, 2, true, 13);
            low.visit_params_mut("", &mut |_, p| {
                p.data = Some(p.data()?.to_dtype(dtype)?);
                Ok(())
            })
            .expect("cast");
            hypershard_nn::to_device(&mut low, d).expect("to_device");
            let on = |t: &Tensor| {
                t.to_dtype(dtype)
                    .and_then(|t| t.to_device(d))
                    .expect("cast")
            };
            let y = low.forward(&on(&x)).expect("forward");
            assert_eq!(y.dtype(), dtype);
            let gx = low.backward(&on(&g)).expect("backward");
            (host_values(&y), host_values(&gx))
        });
        for (got, want) in y.iter().zip(&expected) {
            assert!((got - want).abs() < tol, "{dtype}: {got} vs {want}");
        }
        for (got, want) in gx.iter().zip(&expected_grad) {
            assert!(
                (got - want).abs() < tol * 4.0,
                "{dtype} grad: {got} vs {want}"
            );
        }
    }
}
