// Kernels of GLM-5.3-Flash's parts (`glm5next`) beyond what it shares with DeepSeek V4 and
// Qwen3.8-Flash-Next: the mean over the hyper-connection streams before the head, KDA's
// forget gate, and the k-pool indexer's keys and pools. Appended after qwen4exp.cu.

// h[t] = (sum over the s streams, in order, of x[t][st]) * (1 / s) (grid n x blocks of e;
// the plan's HyperHead::Mean).
extern "C" __global__ void stream_mean(const float* __restrict__ x, float* __restrict__ h, int e,
                                       int s) {
    const int t = blockIdx.x;
    const int i = blockIdx.y * blockDim.x + threadIdx.x;
    if (i >= e) return;
    float a = 0.0f;
    for (int st = 0; st < s; st++) a += x[((size_t)t * s + st) * e + i];
    h[(size_t)t * e + i] = a * (1.0f / (float)s);
}

// KDA's per-channel log-decay in place (grid n x blocks of inner; kda::forget_gate): f =
// f + dt_bias[c], then lb * sigmoid(-a[h] * f) with a lower bound (has_lb), else a[h] *
// softplus(f), h = c / d.
extern "C" __global__ void kda_gate(float* __restrict__ f, const float* __restrict__ dt_bias,
                                    const float* __restrict__ a, int inner, int d, float lb,
                                    int has_lb) {
    const int t = blockIdx.x;
    const int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= inner) return;
    const size_t o = (size_t)t * inner + c;
    const float x = f[o] + dt_bias[c];
    const float ah = a[c / d];
    f[o] = has_lb ? lb * sigmoidf_(-ah * x) : ah * (x > 20.0f ? x : log1pf(expf(x)));
}

// The k-pool indexer's rows of each token (grid n; mla_pooled::select): its key's LayerNorm
// (weight lnw, bias lnb) and its gate logits, each rounded to f16 when `round` (an f16
// cache), into keys[pos] and gates[pos].
extern "C" __global__ void pool_prep(const float* __restrict__ ik, const float* __restrict__ gt,
                                     const float* __restrict__ lnw, const float* __restrict__ lnb,
                                     const int* __restrict__ pos, float* __restrict__ keys,
                                     float* __restrict__ gates, int id, float eps, int round) {
    const int t = blockIdx.x, p = pos[t];
    const float* x = ik + (size_t)t * id;
    float s = 0.0f;
    for (int i = threadIdx.x; i < id; i += blockDim.x) s += x[i];
    const float mean = block_sum(s) / (float)id;
    float v = 0.0f;
    for (int i = threadIdx.x; i < id; i += blockDim.x) v += (x[i] - mean) * (x[i] - mean);
    const float r = 1.0f / sqrtf(block_sum(v) / (float)id + eps);
    for (int i = threadIdx.x; i < id; i += blockDim.x) {
        float y = (x[i] - mean) * r * lnw[i] + lnb[i];
        float gv = gt[(size_t)t * id + i];
        if (round) {
            y = h2f(f2h(y));
            gv = h2f(f2h(gv));
        }
        keys[(size_t)p * id + i] = y;
        gates[(size_t)p * id + i] = gv;
    }
}

// The pool each token completes (grid n; (p + 1) % kp == 0, else nothing): per channel j,
// the softmax over the pool's kp slots of gates[slot][j] + ape[slot][j] weighs the slots'
// keys (summed in slot order), rounded to f16 when `round`, into pooled[p / kp].
extern "C" __global__ void pool_make(const float* __restrict__ keys,
                                     const float* __restrict__ gates,
                                     const float* __restrict__ ape, float* __restrict__ pooled,
                                     const int* __restrict__ pos, int id, int kp, int round) {
    const int p = pos[blockIdx.x];
    if ((p + 1) % kp != 0) return;
    const int b = p / kp;
    const size_t r0 = (size_t)b * kp;
    for (int j = threadIdx.x; j < id; j += blockDim.x) {
        float mx = NEG_INF;
        for (int r = 0; r < kp; r++) mx = fmaxf(mx, gates[(r0 + r) * id + j] + ape[r * id + j]);
        float sum = 0.0f;
        for (int r = 0; r < kp; r++) sum += expf(gates[(r0 + r) * id + j] + ape[r * id + j] - mx);
        float acc = 0.0f;
        for (int r = 0; r < kp; r++) {
            const float w = expf(gates[(r0 + r) * id + j] + ape[r * id + j] - mx) / sum;
            acc += w * keys[(r0 + r) * id + j];
        }
        pooled[(size_t)b * id + j] = round ? h2f(f2h(acc)) : acc;
    }
}
