//! `DeviceMlp`: a `Sequential` of Linear and ReLU layers trained on the device.

use hypershard_tensor::cuda::{CudaDevice, CudaTensor};
use hypershard_tensor::{DType, Tensor};

use super::error::{DeviceError, DeviceResult};
use super::linear::{DeviceLinear, host_param};
use super::loss::mse_loss;
use crate::module::join_name;
use crate::{Module, Relu, Sequential};

/// One layer of a [`DeviceMlp`].
#[derive(Debug)]
#[non_exhaustive]
pub enum DeviceLayer {
    /// A fully connected layer (boxed: it is much larger than a ReLU).
    Linear(Box<DeviceLinear>),
    /// A ReLU, applied in place (`CudaTensor::relu_`); its backward masks the gradient in
    /// place with the ReLU's output (`CudaTensor::relu_grad_`).
    Relu,
}

/// A CPU layer read for the device (host tensors, not yet copied).
#[derive(Debug)]
pub(crate) enum HostLayer {
    Linear {
        weight: Tensor,
        bias: Option<Tensor>,
    },
    Relu,
}

/// Reads `model` for the device: every layer a Linear or a ReLU, every parameter
/// materialised, wanting a gradient and in one dtype with a device GEMM (f32, bf16, f16), and
/// each Linear's input width the previous one's output width. Returns the layers and the dtype.
pub(crate) fn host_layers(model: &Sequential) -> DeviceResult<(Vec<HostLayer>, DType)> {
    const OP: &str = "DeviceMlp::from_cpu";
    let mut layers = Vec::with_capacity(model.layers.len());
    let mut dtype = None;
    let mut width: Option<usize> = None;
    for (index, layer) in model.layers.iter().enumerate() {
        match layer.kind() {
            "ReLU" => layers.push(HostLayer::Relu),
            "Linear" => {
                let prefix = index.to_string();
                let mut weight = None;
                let mut bias = None;
                let mut failure = None;
                layer.visit_params(&prefix, &mut |name, param| {
                    let read = host_param(OP, name, param).cloned();
                    match (name.rsplit('.').next(), read) {
                        (_, Err(e)) => failure = Some(e),
                        (Some("weight"), Ok(t)) => weight = Some(t),
                        (Some("bias"), Ok(t)) => bias = Some(t),
                        _ => {}
                    }
                    Ok(())
                })?;
                if let Some(e) = failure {
                    return Err(e);
                }
                let weight = weight.ok_or(DeviceError::UnsupportedLayer {
                    op: OP,
                    index,
                    kind: "Linear without a weight",
                })?;
                let found = weight.dtype();
                if !matches!(found, DType::F32 | DType::BF16 | DType::F16) {
                    return Err(DeviceError::UnsupportedDType {
                        op: OP,
                        dtype: found,
                    });
                }
                match dtype {
                    Some(d) if d != found => {
                        return Err(DeviceError::DTypeMismatch {
                            op: OP,
                            lhs: d,
                            rhs: found,
                        });
                    }
                    _ => dtype = Some(found),
                }
                let &[out_features, in_features] = weight.shape() else {
                    return Err(DeviceError::BadShape {
                        op: OP,
                        expected: format!("a 2-D weight for {}", join_name(&prefix, "weight")),
                        actual: weight.shape().to_vec(),
                    });
                };
                if let Some(w) = width.filter(|&w| w != in_features) {
                    return Err(DeviceError::BadShape {
                        op: OP,
                        expected: format!("layer {index} to take the previous width {w}"),
                        actual: weight.shape().to_vec(),
                    });
                }
                width = Some(out_features);
                layers.push(HostLayer::Linear { weight, bias });
            }
            kind => {
                return Err(DeviceError::UnsupportedLayer {
                    op: OP,
                    index,
                    kind,
                });
            }
        }
    }
    let dtype = dtype.ok_or(DeviceError::NoParameters { op: OP })?;
    Ok((layers, dtype))
}

/// A multilayer perceptron (a `Sequential` of [`crate::Linear`] and [`crate::Relu`]) with its
/// parameters, gradients and activations on one CUDA device.
///
/// It runs the reference model of the FSDP benchmarks (8 × Linear(1024, 1024) + ReLU, MSE
/// loss, SGD) on a GPU. Parameter names follow the CPU model (`0.weight`, `0.bias`,
/// `2.weight`, ...), so [`DeviceMlp::to_cpu`] gives back a `Sequential` that compares with the
/// CPU run.
///
/// The forward pass keeps what the backward needs: each Linear's input, and each ReLU's
/// output (the ReLU runs in place on the Linear's output, which is also the next Linear's
/// input, so no activation is stored twice). The backward stops at the first Linear: the
/// model's input gradient is not computed (nothing upstream needs it).
#[derive(Debug)]
pub struct DeviceMlp {
    device: CudaDevice,
    dtype: DType,
    layers: Vec<DeviceLayer>,
    /// The activations of the last forward: slot 0 is the input, then one per Linear.
    slots: Vec<CudaTensor>,
    /// For each layer, the slot of its input (a ReLU's input slot holds its output after the
    /// forward, since it runs in place).
    inputs: Vec<usize>,
    /// A `[rows, 1]` column of ones for the bias GEMMs, kept between steps of equal batch.
    ones: Option<CudaTensor>,
}

impl DeviceMlp {
    /// Copies `model` to `device` (see [`host_layers`]'s checks; gradients start at zero).
    pub fn from_cpu(device: &CudaDevice, model: &Sequential) -> DeviceResult<DeviceMlp> {
        let (host, dtype) = host_layers(model)?;
        let layers = host
            .into_iter()
            .map(|layer| match layer {
                HostLayer::Linear { weight, bias } => {
                    DeviceLinear::from_host(device, &weight, bias.as_ref())
                        .map(|l| DeviceLayer::Linear(Box::new(l)))
                }
                HostLayer::Relu => Ok(DeviceLayer::Relu),
            })
            .collect::<DeviceResult<Vec<_>>>()?;
        Ok(DeviceMlp {
            device: device.clone(),
            dtype,
            layers,
            slots: Vec::new(),
            inputs: Vec::new(),
            ones: None,
        })
    }

    /// Opens device `ordinal` and copies `model` to it: on a machine without CUDA (or without
    /// that device) `DeviceError::Cuda(CudaError::Unavailable { .. })`, never a panic.
    pub fn open(ordinal: usize, model: &Sequential) -> DeviceResult<DeviceMlp> {
        let device = CudaDevice::new(ordinal)?;
        DeviceMlp::from_cpu(&device, model)
    }

    /// The device.
    pub fn device(&self) -> &CudaDevice {
        &self.device
    }

    /// The parameters' dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The layers.
    pub fn layers(&self) -> &[DeviceLayer] {
        &self.layers
    }

    /// The layers, taken out of the model (for callers that drive the layers themselves, such
    /// as FSDP on device, which swaps each Linear's parameters for gathered ones).
    pub fn into_layers(self) -> Vec<DeviceLayer> {
        self.layers
    }

    /// A `[rows, 1]` column of ones, reused while the batch size stays the same.
    fn ones(&mut self, rows: usize) -> DeviceResult<()> {
        if self.ones.as_ref().is_none_or(|o| o.shape() != [rows, 1]) {
            let ones = Tensor::ones(&[rows, 1], self.dtype)?;
            self.ones = Some(CudaTensor::from_host(&self.device, &ones)?);
        }
        Ok(())
    }

    /// The forward pass for `input: [rows, in]` (the model's dtype); returns the output.
    pub fn forward(&mut self, input: &CudaTensor) -> DeviceResult<&CudaTensor> {
        const OP: &str = "DeviceMlp::forward";
        if input.dtype() != self.dtype {
            return Err(DeviceError::DTypeMismatch {
                op: OP,
                lhs: self.dtype,
                rhs: input.dtype(),
            });
        }
        let &[rows, _] = input.shape() else {
            return Err(DeviceError::BadShape {
                op: OP,
                expected: "a 2-D input [rows, in]".to_string(),
                actual: input.shape().to_vec(),
            });
        };
        self.ones(rows)?;
        self.slots.clear();
        self.inputs.clear();
        self.slots.push(input.try_clone()?);
        let ones = self
            .ones
            .as_ref()
            .ok_or(DeviceError::NoParameters { op: OP })?;
        for layer in &self.layers {
            let current = self.slots.len() - 1;
            self.inputs.push(current);
            match layer {
                DeviceLayer::Linear(linear) => {
                    let y = linear.forward(&self.slots[current], ones)?;
                    self.slots.push(y);
                }
                DeviceLayer::Relu => self.slots[current].relu_()?,
            }
        }
        let last = self.slots.len() - 1;
        Ok(&self.slots[last])
    }

    /// The backward pass from `grad_output` (the gradient of the last forward's output):
    /// accumulates every parameter's gradient, and frees the activations.
    pub fn backward(&mut self, mut grad: CudaTensor) -> DeviceResult<()> {
        const OP: &str = "DeviceMlp::backward";
        if self.inputs.len() != self.layers.len() || self.slots.is_empty() {
            return Err(DeviceError::BackwardBeforeForward {
                module: "DeviceMlp",
            });
        }
        let last = &self.slots[self.slots.len() - 1];
        if grad.dtype() != last.dtype() {
            return Err(DeviceError::DTypeMismatch {
                op: OP,
                lhs: last.dtype(),
                rhs: grad.dtype(),
            });
        }
        if grad.shape() != last.shape() {
            return Err(DeviceError::BadShape {
                op: OP,
                expected: format!("a gradient of the output's shape {:?}", last.shape()),
                actual: grad.shape().to_vec(),
            });
        }
        let ones = self
            .ones
            .as_ref()
            .ok_or(DeviceError::NoParameters { op: OP })?;
        let first_linear = self
            .layers
            .iter()
            .position(|l| matches!(l, DeviceLayer::Linear(_)))
            .ok_or(DeviceError::NoParameters { op: OP })?;
        for index in (first_linear..self.layers.len()).rev() {
            let input = &self.slots[self.inputs[index]];
            match &mut self.layers[index] {
                DeviceLayer::Relu => grad.relu_grad_(input)?,
                DeviceLayer::Linear(linear) => {
                    match linear.backward(input, &grad, ones, index > first_linear)? {
                        Some(dx) => grad = dx,
                        None => break,
                    }
                }
            }
        }
        self.slots.clear();
        self.inputs.clear();
        Ok(())
    }

    /// Zeroes every gradient.
    pub fn zero_grad(&mut self) -> DeviceResult<()> {
        for layer in &mut self.layers {
            if let DeviceLayer::Linear(linear) = layer {
                linear.zero_grad()?;
            }
        }
        Ok(())
    }

    /// Plain SGD (`p −= lr · grad`, no momentum or weight decay) on every parameter.
    pub fn sgd_step(&mut self, lr: f64) -> DeviceResult<()> {
        for layer in &mut self.layers {
            if let DeviceLayer::Linear(linear) = layer {
                linear.sgd_step(lr)?;
            }
        }
        Ok(())
    }

    /// One training step, as the CPU benchmark's: zero the gradients, forward, MSE loss
    /// against `target`, backward, SGD with `lr`. Returns the loss (reading it back waits for
    /// the forward pass; the step's last kernels may still be running when it returns, and the
    /// next host read, or [`CudaDevice::synchronize`], waits for them).
    pub fn train_step(
        &mut self,
        input: &CudaTensor,
        target: &CudaTensor,
        lr: f64,
    ) -> DeviceResult<f64> {
        self.zero_grad()?;
        let output = self.forward(input)?;
        let loss = mse_loss(output, target)?;
        self.backward(loss.grad)?;
        self.sgd_step(lr)?;
        Ok(loss.loss)
    }

    /// The model back on the host, as a CPU `Sequential` with the same layers and names; with
    /// `grads`, each parameter's `grad` is its device gradient.
    pub fn to_cpu(&self, grads: bool) -> DeviceResult<Sequential> {
        let mut layers: Vec<Box<dyn Module>> = Vec::with_capacity(self.layers.len());
        for layer in &self.layers {
            match layer {
                DeviceLayer::Linear(linear) => layers.push(Box::new(linear.to_cpu(grads)?)),
                DeviceLayer::Relu => layers.push(Box::new(Relu::new())),
            }
        }
        Ok(Sequential::new(layers))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Linear, LinearConfig, Silu};

    fn linear(i: usize, o: usize, dtype: DType, seed: u64) -> Linear {
        Linear::new(LinearConfig {
            in_features: i,
            out_features: o,
            bias: true,
            dtype,
            seed,
        })
        .unwrap()
    }

    #[test]
    fn reads_linear_and_relu_layers() {
        let model = Sequential::default()
            .with(linear(5, 7, DType::F32, 0))
            .with(Relu::new())
            .with(linear(7, 3, DType::F32, 2));
        let (layers, dtype) = host_layers(&model).unwrap();
        assert_eq!(dtype, DType::F32);
        assert_eq!(layers.len(), 3);
        let HostLayer::Linear { weight, bias } = &layers[2] else {
            panic!("{layers:?}")
        };
        assert_eq!(weight.shape(), [3, 7]);
        assert_eq!(bias.as_ref().unwrap().shape(), [3]);
        assert!(matches!(layers[1], HostLayer::Relu));
    }

    #[test]
    fn rejects_what_the_device_cannot_run() {
        let silu = Sequential::default()
            .with(linear(5, 7, DType::F32, 0))
            .with(Silu::new());
        assert!(matches!(
            host_layers(&silu),
            Err(DeviceError::UnsupportedLayer {
                index: 1,
                kind: "SiLU",
                ..
            })
        ));
        let f64_model = Sequential::default().with(linear(2, 2, DType::F64, 0));
        assert!(matches!(
            host_layers(&f64_model),
            Err(DeviceError::UnsupportedDType {
                dtype: DType::F64,
                ..
            })
        ));
        let mixed = Sequential::default()
            .with(linear(2, 2, DType::F32, 0))
            .with(linear(2, 2, DType::BF16, 2));
        assert!(matches!(
            host_layers(&mixed),
            Err(DeviceError::DTypeMismatch {
                lhs: DType::F32,
                rhs: DType::BF16,
                ..
            })
        ));
        let widths = Sequential::default()
            .with(linear(2, 3, DType::F32, 0))
            .with(linear(4, 2, DType::F32, 2));
        assert!(matches!(
            host_layers(&widths),
            Err(DeviceError::BadShape { .. })
        ));
        assert!(matches!(
            host_layers(&Sequential::default().with(Relu::new())),
            Err(DeviceError::NoParameters { .. })
        ));
        let mut frozen = linear(2, 2, DType::F32, 0);
        frozen.weight.requires_grad = false;
        match host_layers(&Sequential::default().with(frozen)) {
            Err(DeviceError::FrozenParameter { name, .. }) => assert_eq!(name, "0.weight"),
            other => panic!("{other:?}"),
        }
        let mut freed = linear(2, 2, DType::F32, 0);
        freed.bias.as_mut().unwrap().data = None;
        assert!(matches!(
            host_layers(&Sequential::default().with(freed)),
            Err(DeviceError::Nn(crate::Error::NotMaterialised { .. }))
        ));
    }
}
