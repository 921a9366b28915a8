// Checks of the GPT kernels of kernels.cu, compiled for the host with prelude.h (see run.sh):
// each kernel against a straightforward host reference of the CPU formula.
#include "prelude.h"
#include "gpt_kernels.inc"
#include <cstdio>
#include <random>
#include <fstream>

static int failures = 0;
#define CHECK(cond, ...) do { if (!(cond)) { ++failures; std::printf("FAIL: " __VA_ARGS__); std::printf("\n"); } } while (0)

std::vector<float> rnd(size_t n, float lo, float hi, unsigned seed) {
    std::mt19937 g(seed); std::uniform_real_distribution<float> d(lo, hi);
    std::vector<float> v(n); for (auto& x : v) x = d(g); return v;
}

// The pointwise layers with kernels (exact GELU, tanh GELU, SiLU, dropout) against the Rust
// CPU's bits, dumped by nn's `pointwise_reference` example: x, g, then the forward and the
// input gradient per layer.
using Pointwise = void (*)(float*, const float*, u64);
using PointwiseGrad = void (*)(float*, const float*, const float*, u64);

void test_pointwise() {
    std::ifstream f("pointwise.bin", std::ios::binary);
    size_t n = 400000;
    std::vector<float> x(n), g(n), y(n), dx(n), yd(n), dxd(n);
    f.read((char*)x.data(), 4 * n); f.read((char*)g.data(), 4 * n);
    const char* names[] = {"gelu", "gelu tanh", "silu"};
    Pointwise forward[] = {gelu_f32, gelu_tanh_f32, silu_f32};
    PointwiseGrad backward[] = {gelu_grad_f32, gelu_tanh_grad_f32, silu_grad_f32};
    for (int a = 0; a < 3; ++a) {
        f.read((char*)y.data(), 4 * n); f.read((char*)dx.data(), 4 * n);
        CHECK(f.good(), "activations.bin holds too few values for %s", names[a]);
        // Few blocks: each thread takes many elements through the grid-stride loop.
        launch(3, 256, [&] { forward[a](yd.data(), x.data(), n); });
        launch(5, 256, [&] { backward[a](dxd.data(), g.data(), x.data(), n); });
        size_t bad_y = 0, bad_dx = 0;
        for (size_t i = 0; i < n; ++i) {
            if (__float_as_uint(y[i]) != __float_as_uint(yd[i])) { if (bad_y++ < 3) std::printf("%s x=%.9g cpu %.9g emu %.9g\n", names[a], x[i], y[i], yd[i]); }
            if (__float_as_uint(dx[i]) != __float_as_uint(dxd[i])) { if (bad_dx++ < 3) std::printf("%s' x=%.9g cpu %.9g emu %.9g\n", names[a], x[i], dx[i], dxd[i]); }
        }
        CHECK(bad_y == 0 && bad_dx == 0, "%s: %zu forward and %zu backward differ from the Rust CPU bits", names[a], bad_y, bad_dx);
        if (bad_y == 0 && bad_dx == 0) std::printf("%s: %zu values compared bit for bit\n", names[a], n);
    }
    // Dropout(0.3), seed 77: the backward is the same mask on the gradient.
    f.read((char*)y.data(), 4 * n); f.read((char*)dx.data(), 4 * n);
    CHECK(f.good(), "pointwise.bin holds too few values for dropout");
    double p = 0.3, keep = 1.0 / (1.0 - 0.3);
    launch(3, 256, [&] { dropout_f32(yd.data(), x.data(), n, 77, p, keep); });
    launch(5, 256, [&] { dropout_f32(dxd.data(), g.data(), n, 77, p, keep); });
    size_t bad = 0, dropped = 0;
    for (size_t i = 0; i < n; ++i) {
        if (__float_as_uint(y[i]) != __float_as_uint(yd[i]) || __float_as_uint(dx[i]) != __float_as_uint(dxd[i])) { if (bad++ < 3) std::printf("dropout i=%zu cpu %.9g %.9g emu %.9g %.9g\n", i, y[i], dx[i], yd[i], dxd[i]); }
        dropped += yd[i] == 0.0f && x[i] != 0.0f;
    }
    // About 30 % dropped: a mask that kept or dropped everything would match nothing useful.
    CHECK(bad == 0 && dropped > n / 4 && dropped < n * 7 / 20, "dropout: %zu differ, %zu of %zu dropped", bad, dropped, n);
    if (bad == 0) std::printf("dropout: %zu values compared bit for bit, %zu dropped\n", n, dropped);
    // SGD (the example's SGD_CASES): three steps per case from p = x[0..m), step k's gradient
    // g[k·m..(k+1)·m); the parameter and the momentum buffer after each step.
    size_t m = 100000;
    struct Case { double momentum, dampening, wd; u32 nesterov; } cases[] = {
        {0.9, 0.1, 0.01, 0}, {0.8, 0.0, 0.0, 1}, {0.0, 0.0, 0.05, 0}};
    for (const Case& c : cases) {
        std::vector<float> param(x.begin(), x.begin() + m), buf(m, 0.0f), want_p(m), want_b(m);
        size_t differ = 0;
        for (size_t step = 0; step < 3; ++step) {
            const float* grad = g.data() + step * m;
            launch(3, 256, [&] { sgd_f32(param.data(), buf.data(), grad, m, 0.05, c.momentum, c.dampening, c.wd, c.momentum != 0.0, c.nesterov, step == 0); });
            f.read((char*)want_p.data(), 4 * m); f.read((char*)want_b.data(), 4 * m);
            CHECK(f.good(), "pointwise.bin holds too few values for sgd");
            for (size_t i = 0; i < m; ++i)
                if (__float_as_uint(param[i]) != __float_as_uint(want_p[i]) || __float_as_uint(buf[i]) != __float_as_uint(want_b[i])) {
                    if (differ++ < 3) std::printf("sgd mu=%g step %zu i=%zu cpu %.9g %.9g emu %.9g %.9g\n", c.momentum, step, i, want_p[i], want_b[i], param[i], buf[i]);
                }
        }
        // The steps moved the parameter: a kernel that did nothing would not match anyway,
        // but say how far it went.
        double moved = 0; for (size_t i = 0; i < m; ++i) moved = std::max(moved, std::fabs((double)param[i] - x[i]));
        CHECK(differ == 0 && moved > 0.01, "sgd mu=%g nesterov=%u wd=%g: %zu values differ from the Rust CPU bits (moved %g)", c.momentum, c.nesterov, c.wd, differ, moved);
        if (differ == 0) std::printf("sgd mu=%g nesterov=%u wd=%g: 3 steps of %zu values compared bit for bit\n", c.momentum, c.nesterov, c.wd, m);
    }
}

// LayerNorm (`center`) or RMSNorm (no centring: mean taken as 0 throughout) against a double
// reference.
void test_norm(size_t rows, size_t d, unsigned grid, bool has_bias, bool center) {
    auto x = rnd(rows * d, 2, 4, 1), w = rnd(d, 0.5, 1.5, 2), b = rnd(d, -1, 1, 3), g = rnd(rows * d, -1, 1, 4);
    std::vector<float> out(rows * d), xhat(rows * d), rstd(rows), dx(rows * d), dw(d, 0.25f), db(d, -0.5f);
    float inv_d = (float)(1.0 / d), eps = (float)1e-5;
    launch(grid, 256, [&] { layer_norm_f32(out.data(), xhat.data(), rstd.data(), x.data(), w.data(), b.data(), has_bias, center, rows, d, inv_d, eps); });
    launch(grid, 256, [&] { layer_norm_backward_f32(dx.data(), g.data(), xhat.data(), rstd.data(), w.data(), center, rows, d, inv_d); });
    launch(1, 256, [&] { layer_norm_param_grad_f32(dw.data(), has_bias ? db.data() : nullptr, g.data(), xhat.data(), has_bias, rows, d); });
    double worst = 0, worst_dx = 0;
    std::vector<double> dw_ref(d, 0.25), db_ref(d, -0.5);
    for (size_t r = 0; r < rows; ++r) {
        double mean = 0;
        if (center) { for (size_t j = 0; j < d; ++j) mean += x[r * d + j]; mean /= d; }
        double var = 0; for (size_t j = 0; j < d; ++j) var += (x[r * d + j] - mean) * (x[r * d + j] - mean); var /= d;
        double rs = 1 / std::sqrt(var + 1e-5);
        double sg = 0, sgx = 0;
        std::vector<double> xh(d);
        for (size_t j = 0; j < d; ++j) {
            xh[j] = (x[r * d + j] - mean) * rs;
            double o = xh[j] * w[j] + (has_bias ? b[j] : 0);
            worst = std::max(worst, std::fabs(o - out[r * d + j]));
            double gh = g[r * d + j] * (double)w[j]; sg += gh; sgx += gh * xh[j];
            dw_ref[j] += g[r * d + j] * xh[j]; db_ref[j] += g[r * d + j];
        }
        CHECK(std::fabs(rs - rstd[r]) < 1e-5 * rs, "norm rstd row %zu", r);
        for (size_t j = 0; j < d; ++j) {
            double want = rs * (g[r * d + j] * (double)w[j] - (center ? sg / d : 0.0) - xh[j] * sgx / d);
            worst_dx = std::max(worst_dx, std::fabs(want - dx[r * d + j]));
        }
    }
    double worst_dw = 0, worst_db = 0;
    for (size_t j = 0; j < d; ++j) { worst_dw = std::max(worst_dw, std::fabs(dw_ref[j] - dw[j])); worst_db = std::max(worst_db, std::fabs(db_ref[j] - db[j])); }
    const char* name = center ? "layer norm" : "rms norm";
    CHECK(worst < 1e-4 && worst_dx < 1e-3 && worst_dw < 1e-3 && (!has_bias || worst_db < 1e-4),
          "%s rows %zu d %zu: out %g dx %g dw %g db %g", name, rows, d, worst, worst_dx, worst_dw, worst_db);
    if (!has_bias) CHECK(db[0] == -0.5f, "db written without a bias");
    std::printf("%s rows %zu d %zu grid %u bias %d: max errors out %.2e dx %.2e dw %.2e db %.2e\n", name, rows, d, grid, has_bias, worst, worst_dx, worst_dw, has_bias ? worst_db : 0.0);
}

void test_softmax(size_t heads, size_t t, unsigned grid) {
    size_t rows = heads * t;
    auto s = rnd(rows * t, -8, 8, 5), g = rnd(rows * t, -1, 1, 6);
    auto p = s;
    float scale = (float)(1.0 / std::sqrt(12.0));
    launch(grid, 256, [&] { causal_softmax_f32(p.data(), rows, t, scale); });
    auto ds = g;
    launch(grid, 256, [&] { causal_softmax_backward_f32(ds.data(), p.data(), rows, t, scale); });
    double worst = 0, worst_ds = 0; bool masked_ok = true;
    for (size_t r = 0; r < rows; ++r) {
        size_t i = r % t;
        double mx = -1e30; for (size_t j = 0; j <= i; ++j) mx = std::max(mx, (double)s[r * t + j] * scale);
        double sum = 0; for (size_t j = 0; j <= i; ++j) sum += std::exp(s[r * t + j] * (double)scale - mx);
        for (size_t j = 0; j < t; ++j) {
            double want = j <= i ? std::exp(s[r * t + j] * (double)scale - mx) / sum : 0;
            if (j > i && p[r * t + j] != 0.0f) masked_ok = false;
            worst = std::max(worst, std::fabs(want - p[r * t + j]));
        }
        double dot = 0; for (size_t j = 0; j < t; ++j) dot += (double)p[r * t + j] * g[r * t + j];
        for (size_t j = 0; j < t; ++j) worst_ds = std::max(worst_ds, std::fabs(scale * (double)p[r * t + j] * (g[r * t + j] - dot) - ds[r * t + j]));
    }
    CHECK(masked_ok && worst < 1e-6 && worst_ds < 1e-6, "softmax heads %zu t %zu: %g %g masked %d", heads, t, worst, worst_ds, masked_ok);
    std::printf("softmax heads %zu t %zu grid %u: max errors p %.2e ds %.2e\n", heads, t, grid, worst, worst_ds);
}

void test_cross_entropy(size_t rows, size_t v, unsigned grid) {
    auto x = rnd(rows * v, -6, 6, 7);
    std::vector<long long> targets(rows);
    std::mt19937 gen(8);
    size_t counted = 0;
    for (size_t r = 0; r < rows; ++r) { targets[r] = (r % 5 == 3) ? -1 : (long long)(gen() % v); counted += targets[r] >= 0; }
    float scale = (float)(1.0 / counted);
    std::vector<float> grad(rows * v, 7.0f); std::vector<double> loss(rows, 9.0);
    launch(grid, 256, [&] { cross_entropy_f32(grad.data(), loss.data(), x.data(), targets.data(), rows, v, scale); });
    double worst_g = 0, worst_l = 0;
    for (size_t r = 0; r < rows; ++r) {
        if (targets[r] < 0) {
            for (size_t j = 0; j < v; ++j) CHECK(grad[r * v + j] == 0.0f, "ignored row %zu grad", r);
            CHECK(loss[r] == 0.0, "ignored row loss");
            continue;
        }
        double mx = -1e30; for (size_t j = 0; j < v; ++j) mx = std::max(mx, (double)x[r * v + j]);
        double sum = 0; for (size_t j = 0; j < v; ++j) sum += std::exp(x[r * v + j] - mx);
        double want_loss = std::log(sum) + mx - x[r * v + targets[r]];
        worst_l = std::max(worst_l, std::fabs(want_loss - loss[r]));
        for (size_t j = 0; j < v; ++j) {
            double want = std::exp(x[r * v + j] - mx) / sum * scale - (j == (size_t)targets[r] ? scale : 0.0);
            worst_g = std::max(worst_g, std::fabs(want - grad[r * v + j]));
        }
    }
    CHECK(worst_l < 1e-5 && worst_g < 1e-7, "cross entropy rows %zu v %zu: loss %g grad %g", rows, v, worst_l, worst_g);
    std::printf("cross entropy rows %zu v %zu grid %u: max errors loss %.2e grad %.2e\n", rows, v, grid, worst_l, worst_g);
}

void test_embedding() {
    size_t batch = 3, seq = 11, v = 67, c = 24, p = 16, n = batch * seq;
    auto wte = rnd(v * c, -1, 1, 9), wpe = rnd(p * c, -1, 1, 10), g = rnd(n * c, -1, 1, 11);
    std::vector<long long> ids(n); std::mt19937 gen(12);
    for (auto& id : ids) id = gen() % 13;
    // The host's counting sort (nn_ops.rs positions_by_row), re-done here.
    std::vector<long long> offsets(v + 1, 0), order(n);
    for (auto id : ids) offsets[id + 1]++;
    for (size_t k = 0; k < v; ++k) offsets[k + 1] += offsets[k];
    std::vector<long long> next(offsets.begin(), offsets.end() - 1);
    for (size_t pos = 0; pos < n; ++pos) order[next[ids[pos]]++] = pos;
    std::vector<float> out(n * c);
    launch(2, 256, [&] { embedding_f32(out.data(), wte.data(), wpe.data(), ids.data(), n, seq, c, 1u); });
    bool ok = true;
    for (size_t pos = 0; pos < n; ++pos) for (size_t col = 0; col < c; ++col)
        ok &= out[pos * c + col] == wte[ids[pos] * c + col] + wpe[(pos % seq) * c + col];
    CHECK(ok, "embedding forward");
    // Without positions (nn's Embedding): the table's rows alone; `wpe` is never read.
    launch(2, 256, [&] { embedding_f32(out.data(), wte.data(), nullptr, ids.data(), n, seq, c, 0u); });
    ok = true;
    for (size_t pos = 0; pos < n; ++pos) for (size_t col = 0; col < c; ++col)
        ok &= out[pos * c + col] == wte[ids[pos] * c + col];
    CHECK(ok, "embedding forward without positions");
    auto gw = rnd(v * c, -1, 1, 13), gp = rnd(p * c, -1, 1, 14);
    auto want_w = gw, want_p = gp;
    std::vector<float> acc(v * c, 0.0f); std::vector<bool> used(v);
    for (size_t pos = 0; pos < n; ++pos) { used[ids[pos]] = true; for (size_t col = 0; col < c; ++col) acc[ids[pos] * c + col] += g[pos * c + col]; }
    for (size_t r = 0; r < v; ++r) if (used[r]) for (size_t col = 0; col < c; ++col) want_w[r * c + col] += acc[r * c + col];
    for (size_t t = 0; t < seq; ++t) for (size_t col = 0; col < c; ++col) { float a = 0; for (size_t b = 0; b < batch; ++b) a += g[(b * seq + t) * c + col]; want_p[t * c + col] += a; }
    launch(2, 256, [&] { embedding_backward_f32(gw.data(), g.data(), offsets.data(), order.data(), v, c); });
    launch(1, 256, [&] { position_backward_f32(gp.data(), g.data(), batch, seq, c); });
    CHECK(std::memcmp(gw.data(), want_w.data(), 4 * v * c) == 0, "embedding backward wte");
    CHECK(std::memcmp(gp.data(), want_p.data(), 4 * p * c) == 0, "embedding backward wpe");
    std::printf("embedding forward/backward compared bit for bit\n");
}

void test_heads() {
    size_t batch = 3, seq = 5, h = 2, hd = 3, c = h * hd;
    auto rows = rnd(batch * seq * 3 * c, -1, 1, 15);
    std::vector<float> back(rows.size(), 0.0f);
    for (size_t part = 0; part < 3; ++part) {
        std::vector<float> heads(batch * h * seq * hd);
        launch(1, 256, [&] { split_heads_f32(heads.data(), rows.data(), batch, seq, h, hd, part, 3); });
        for (size_t b = 0; b < batch; ++b) for (size_t hh = 0; hh < h; ++hh) for (size_t t = 0; t < seq; ++t) for (size_t d = 0; d < hd; ++d)
            CHECK(heads[((b * h + hh) * seq + t) * hd + d] == rows[(b * seq + t) * 3 * c + part * c + hh * hd + d], "split part %zu", part);
        launch(1, 256, [&] { merge_heads_f32(back.data(), heads.data(), batch, seq, h, hd, part, 3); });
    }
    CHECK(back == rows, "merge of splits");
    std::printf("heads split/merge exact\n");
}

void test_adamw() {
    size_t n = 1001;
    auto p = rnd(n, -1, 1, 16);
    std::vector<float> m(n, 0), v(n, 0);
    std::vector<double> pr(p.begin(), p.end()), mr(n, 0), vr(n, 0);
    double lr = 1e-2, b1 = 0.9, b2 = 0.95, eps = 1e-8, wd = 0.1;
    for (int step = 1; step <= 3; ++step) {
        auto g = rnd(n, -1, 1, 16 + step);
        double bc1 = 1 - std::pow(b1, step), bc2s = std::sqrt(1 - std::pow(b2, step));
        launch(2, 256, [&] { adamw_f32(p.data(), m.data(), v.data(), g.data(), n, (float)(1 - lr * wd), (float)b1, (float)(1 - b1), (float)b2, (float)(1 - b2), (float)(lr / bc1), (float)bc2s, (float)eps); });
        for (size_t i = 0; i < n; ++i) {
            pr[i] *= 1 - lr * wd; mr[i] = b1 * mr[i] + (1 - b1) * g[i]; vr[i] = b2 * vr[i] + (1 - b2) * g[i] * g[i];
            pr[i] -= lr / bc1 * mr[i] / (std::sqrt(vr[i]) / bc2s + eps);
        }
    }
    double worst = 0; for (size_t i = 0; i < n; ++i) worst = std::max(worst, std::fabs(pr[i] - p[i]) / (std::fabs(pr[i]) + lr));
    CHECK(worst < 30 * 6e-8, "adamw %g", worst);
    std::printf("adamw: worst relative error %.2e\n", worst);
}

// The tiled attention (forward, delta, dq, dk/dv) against a double reference of
// dropout(softmax(q kᵀ·scale + causal mask)) v and its gradients, with the dropout mask drawn
// from the same counter, on a grid smaller than the work.
void test_flash(size_t batch, size_t t, size_t heads, size_t d, double p) {
    size_t c = heads * d;
    auto qkv = rnd(batch * t * 3 * c, -1, 1, 40 + t), dout = rnd(batch * t * c, -1, 1, 41 + t);
    std::vector<float> out(batch * t * c), lse(batch * heads * t), delta(batch * heads * t), dqkv(batch * t * 3 * c, 7.0f);
    float scale = 1.0f / std::sqrt((float)d);
    u64 seed = 99;
    double keep = p > 0 ? 1.0 / (1.0 - p) : 1.0;
    u32 on = p > 0;
    launch(3, 64, [&] { flash_forward_f32(out.data(), lse.data(), qkv.data(), batch, t, heads, d, scale, seed, p, keep, on); });
    launch(2, 256, [&] { flash_backward_delta_f32(delta.data(), out.data(), dout.data(), batch, t, heads, d); });
    launch(3, 64, [&] { flash_backward_dq_f32(dqkv.data(), qkv.data(), dout.data(), lse.data(), delta.data(), batch, t, heads, d, scale, seed, p, keep, on); });
    launch(2, 64, [&] { flash_backward_dkv_f32(dqkv.data(), qkv.data(), dout.data(), lse.data(), delta.data(), batch, t, heads, d, scale, seed, p, keep, on); });
    std::vector<double> rout(out.size(), 0), rd(dqkv.size(), 0);
    double worst_out = 0, worst_grad = 0, dropped = 0, weights = 0;
    for (size_t b = 0; b < batch; ++b) for (size_t h = 0; h < heads; ++h) {
        auto q = [&](size_t i, size_t e) { return (double)qkv[(b * t + i) * 3 * c + h * d + e]; };
        auto k = [&](size_t j, size_t e) { return (double)qkv[(b * t + j) * 3 * c + c + h * d + e]; };
        auto v = [&](size_t j, size_t e) { return (double)qkv[(b * t + j) * 3 * c + 2 * c + h * d + e]; };
        auto go = [&](size_t i, size_t e) { return (double)dout[(b * t + i) * c + h * d + e]; };
        size_t bh = b * heads + h;
        std::vector<double> P(t * t, 0), M(t * t, 0), dS(t * t, 0);
        for (size_t i = 0; i < t; ++i) {
            double mx = -1e300;
            for (size_t j = 0; j <= i; ++j) { double s = 0; for (size_t e = 0; e < d; ++e) s += q(i, e) * k(j, e); P[i * t + j] = s * scale; mx = std::max(mx, s * scale); }
            double sum = 0; for (size_t j = 0; j <= i; ++j) { P[i * t + j] = std::exp(P[i * t + j] - mx); sum += P[i * t + j]; }
            for (size_t j = 0; j <= i; ++j) {
                P[i * t + j] /= sum;
                M[i * t + j] = on ? (random_unit(seed, (bh * t + i) * t + j) < p ? 0.0 : keep) : 1.0;
                dropped += M[i * t + j] == 0.0; weights += 1;
            }
            worst_out = std::max(worst_out, std::fabs(lse[bh * t + i] - (mx + std::log(sum))) / (1 + std::fabs(mx + std::log(sum))));
            for (size_t e = 0; e < d; ++e) { double o = 0; for (size_t j = 0; j <= i; ++j) o += P[i * t + j] * M[i * t + j] * v(j, e); rout[(b * t + i) * c + h * d + e] = o; }
            // dP = (dO_i · v_j)·mask; dS = P (dP − Σ_k P dP).
            double row = 0; std::vector<double> dP(i + 1);
            for (size_t j = 0; j <= i; ++j) { double s = 0; for (size_t e = 0; e < d; ++e) s += go(i, e) * v(j, e); dP[j] = s * M[i * t + j]; row += P[i * t + j] * dP[j]; }
            for (size_t j = 0; j <= i; ++j) dS[i * t + j] = P[i * t + j] * (dP[j] - row);
        }
        for (size_t i = 0; i < t; ++i) for (size_t e = 0; e < d; ++e) {
            double dq = 0, dk = 0, dv = 0;
            for (size_t j = 0; j <= i; ++j) dq += dS[i * t + j] * k(j, e);
            for (size_t r = i; r < t; ++r) { dk += dS[r * t + i] * q(r, e); dv += P[r * t + i] * M[r * t + i] * go(r, e); }
            rd[(b * t + i) * 3 * c + h * d + e] = dq * scale;
            rd[(b * t + i) * 3 * c + c + h * d + e] = dk * scale;
            rd[(b * t + i) * 3 * c + 2 * c + h * d + e] = dv;
        }
    }
    for (size_t x = 0; x < out.size(); ++x) worst_out = std::max(worst_out, std::fabs(out[x] - rout[x]) / (1 + std::fabs(rout[x])));
    for (size_t x = 0; x < dqkv.size(); ++x) worst_grad = std::max(worst_grad, std::fabs(dqkv[x] - rd[x]) / (1 + std::fabs(rd[x])));
    CHECK(worst_out < 2e-6 && worst_grad < 1e-5, "flash b %zu t %zu h %zu d %zu p %g: max errors out %g grad %g", batch, t, heads, d, p, worst_out, worst_grad);
    // With dropout, about p of the weights are dropped (the mask is really drawn).
    CHECK(!on || (dropped > 0.7 * p * weights && dropped < 1.3 * p * weights), "flash dropout: %g of %g dropped", dropped, weights);
    std::printf("flash b %zu t %zu h %zu d %zu p %g: max errors out %.2e grad %.2e\n", batch, t, heads, d, p, worst_out, worst_grad);
}

int main() {
    test_pointwise();
    test_norm(37, 24, 5, true, true);
    test_norm(29, 300, 29, true, true);
    test_norm(9, 700, 4, false, true);
    // RMSNorm: the inputs lie in [2, 4], far from zero mean, so a kernel that still centred
    // would miss by far more than the tolerance.
    test_norm(37, 24, 5, false, false);
    test_norm(9, 700, 4, false, false);
    test_softmax(6, 16, 7);
    test_softmax(2, 300, 64);
    test_cross_entropy(37, 67, 5);
    test_cross_entropy(23, 1000, 23);
    test_embedding();
    test_heads();
    test_adamw();
    test_flash(2, 70, 2, 16, 0.0);
    test_flash(1, 37, 3, 8, 0.2);
    test_flash(1, 33, 1, 128, 0.1);
    std::printf("%s (%d failures)\n", failures ? "FAILED" : "all passed", failures);
    return failures != 0;
}
