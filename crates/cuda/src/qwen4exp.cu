// Kernels of Qwen3.8-Flash-Next's parts (`qwen4exp`): the low-rank hyper-connection mixers,
// the hashed n-gram PLE layer, Gated DeltaNet and QSA indexed attention, and the causal
// depthwise convolution over a per-sequence ring that DeltaNet and PLE share (the
// convolution, the delta rule and the block expansion serve GLM-5.3-Flash's KDA and pools
// too). Appended
// after forward.cu (block_sum, the indexer's scores and top-k, the attention come from
// there). Each mirrors a CPU block of sluice_models::blocks (named per kernel); sums keep
// the CPU's order where a thread owns them.

__device__ __forceinline__ float silu_f(float x) { return x * sigmoidf_(x); }

// out[r][g] = rms_norm(x[r][g]) * w[g] for every `e`-wide group g of row r (grid rows x
// groups; w holds groups * e values, group g's from g * e): hyper_lowrank::rms_norm_grouped.
extern "C" __global__ void rms_groups(const float* __restrict__ x, const float* __restrict__ w,
                                      float* __restrict__ out, int e, float eps) {
    const size_t base = ((size_t)blockIdx.x * gridDim.y + blockIdx.y) * e;
    const float* wg = w + (size_t)blockIdx.y * e;
    const float s = rms_inv(x + base, e, eps);
    for (int i = threadIdx.x; i < e; i += blockDim.x) out[base + i] = x[base + i] * s * wg[i];
}

// A low-rank mixer's activations (grid n): u[t][i] = silu(d * inv_s) of the sum d, in
// segment order, of the down product's nseg partial sums part[t][seg][i], for its r values;
// inj[t][j] = 2 sigmoid(inj[t][j] * inv_s) for its s values (inj null: none).
extern "C" __global__ void lr_act(const float* __restrict__ part, float* __restrict__ u,
                                  float* __restrict__ inj, int r, int s, int nseg, float inv_s) {
    const size_t t = blockIdx.x;
    for (int i = threadIdx.x; i < r; i += blockDim.x) {
        float d = 0.0f;
        for (int sg = 0; sg < nseg; sg++) d += part[(t * nseg + sg) * r + i];
        u[t * r + i] = silu_f(d * inv_s);
    }
    if (!inj) return;
    for (int j = threadIdx.x; j < s; j += blockDim.x)
        inj[t * s + j] = 2.0f * sigmoidf_(inj[t * s + j] * inv_s);
}

// A low-rank mixer's block input (grid n x blocks of e): m[t][i] = (sum over the s streams,
// in order, of sigmoid(gw[t][st][i]) * xn[t][st][i]) * (1 / s) (hyper_lowrank::hc_pre).
extern "C" __global__ void lr_mix(const float* __restrict__ gw, const float* __restrict__ xn,
                                  float* __restrict__ m, int e, int s) {
    const int t = blockIdx.x;
    const int i = blockIdx.y * blockDim.x + threadIdx.x;
    if (i >= e) return;
    const size_t base = (size_t)t * s * e + i;
    float a = 0.0f;
    for (int st = 0; st < s; st++) a += sigmoidf_(gw[base + (size_t)st * e]) * xn[base + (size_t)st * e];
    m[(size_t)t * e + i] = a * (1.0f / (float)s);
}

// x[t][st] += inj[t][st] * y[t] for every stream (grid n x blocks of e):
// hyper_lowrank::hc_post.
extern "C" __global__ void lr_post(float* __restrict__ x, const float* __restrict__ y,
                                   const float* __restrict__ inj, int e, int s) {
    const int t = blockIdx.x;
    const int i = blockIdx.y * blockDim.x + threadIdx.x;
    if (i >= e) return;
    const float yv = y[(size_t)t * e + i];
    for (int st = 0; st < s; st++) x[((size_t)t * s + st) * e + i] += inj[t * s + st] * yv;
}

// The PLE layer's gate (grid n x streams): c = <k[t][st], q[t][st]> / sqrt(e), g =
// sigmoid(sign(c) sqrt(max(|c|, 1e-6))) (c = 0: g = 0.5), gv[t][st] = g * v[t]
// (ple::ple_apply).
extern "C" __global__ void ple_gate(const float* __restrict__ k, const float* __restrict__ q,
                                    const float* __restrict__ v, float* __restrict__ gv, int e) {
    const int t = blockIdx.x;
    const size_t o = ((size_t)t * gridDim.y + blockIdx.y) * e;
    float d = 0.0f;
    for (int i = threadIdx.x; i < e; i += blockDim.x) d += k[o + i] * q[o + i];
    d = block_sum(d);
    const float c = d * (1.0f / sqrtf((float)e));
    const float g = sigmoidf_(c == 0.0f ? 0.0f : copysignf(sqrtf(fmaxf(fabsf(c), 1e-6f)), c));
    for (int i = threadIdx.x; i < e; i += blockDim.x) gv[o + i] = g * v[(size_t)t * e + i];
}

// Causal depthwise convolution of `width` channels (grid n x blocks of width): y = silu(sum
// over taps j < kernel, in order, of w[c][j] * val(p - (kernel - 1 - j) * dil)), val(q) the
// channel's input at position q: 0 before the sequence, in[q - pos[0]] within the batch
// (its positions are consecutive), else the ring's slot q % ((kernel - 1) * dil), which
// ring_store fills with the last positions after every read. gv null: out = y
// (DeltaNet's q|k|v); else out += gv + y (the PLE layer's residual update).
extern "C" __global__ void conv_ring(const float* __restrict__ in, const float* __restrict__ ring,
                                     const float* __restrict__ w, const float* __restrict__ gv,
                                     float* __restrict__ out, const int* __restrict__ pos,
                                     int width, int kernel, int dil) {
    const int t = blockIdx.x;
    const int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= width) return;
    const int p = pos[t], p0 = pos[0];
    const int slots = (kernel - 1) * dil;
    float acc = 0.0f;
    for (int j = 0; j < kernel; j++) {
        const int qp = p - (kernel - 1 - j) * dil;
        float v = 0.0f;
        if (qp >= p0) {
            v = in[(size_t)(qp - p0) * width + c];
        } else if (qp >= 0) {
            v = ring[(size_t)(qp % slots) * width + c];
        }
        acc += w[(size_t)c * kernel + j] * v;
    }
    const float y = silu_f(acc);
    const size_t o = (size_t)t * width + c;
    if (gv) {
        out[o] += gv[o] + y;
    } else {
        out[o] = y;
    }
}

#define GDN_THREADS 128
// Most value columns one thread owns (dv <= GDN_THREADS * GDN_COLS).
#define GDN_COLS 4

// The delta rule of a linear-attention layer for value head j = blockIdx.x over the batch's
// n tokens in order (Gated DeltaNet, deltanet::delta_net; Kimi delta attention, kda::kda):
// q and k of key head j % hk (rows q + t * ts + (j % hk) * dk, likewise k; v + t * ts + j *
// dv), L2-normed, q times 1 / sqrt(dk); beta = sigmoid(beta[t][j]); the state's rows decay
// by exp(a[j] * softplus(g[t][j] + dt_bias[j])) (per_channel 0: DeltaNet's one rate per
// head) or row i by exp(g[t][j * dk + i]) (per_channel 1: KDA's log-decay per key
// channel); the rule on the head's [dk][dv] state (state, f32; zeros when the batch starts
// at position 0), held in dynamic shared memory meanwhile, each thread owning value
// columns and summing over the dk rows in order (sluice_kernels::delta_rule's two passes);
// then the gated RMS norm out = rms(o) * norm * act(z) (act sigmoid or SiLU).
extern "C" __global__ void __launch_bounds__(GDN_THREADS)
    delta_rule(const float* __restrict__ q, const float* __restrict__ k,
               const float* __restrict__ v, const float* __restrict__ beta,
               const float* __restrict__ g, const float* __restrict__ z,
               const float* __restrict__ a, const float* __restrict__ dt_bias,
               const float* __restrict__ norm, float* __restrict__ state,
               float* __restrict__ out, const int* __restrict__ pos, int ts, int n, int hk,
               int dk, int dv, int gate_sigmoid, int per_channel, float eps) {
    extern __shared__ float gdn_smem[];
    float* S = gdn_smem;  // [dk][dv]
    float* qs = S + (size_t)dk * dv;
    float* ks = qs + dk;
    float* dec = ks + dk;
    const int j = blockIdx.x, hv = gridDim.x, kh = j % hk, tid = threadIdx.x;
    float* sg = state + (size_t)j * dk * dv;
    const bool fresh = pos[0] == 0;
    for (int i = tid; i < dk * dv; i += GDN_THREADS) S[i] = fresh ? 0.0f : sg[i];
    __syncthreads();
    const float q_scale = 1.0f / sqrtf((float)dk);
    for (int t = 0; t < n; t++) {
        const float* qr = q + (size_t)t * ts + kh * dk;
        const float* kr = k + (size_t)t * ts + kh * dk;
        float sq = 0.0f, sk = 0.0f;
        for (int i = tid; i < dk; i += GDN_THREADS) {
            const float qv = qr[i], kv = kr[i];
            qs[i] = qv;
            ks[i] = kv;
            sq += qv * qv;
            sk += kv * kv;
            if (per_channel) dec[i] = expf(g[((size_t)t * hv + j) * dk + i]);
        }
        sq = block_sum(sq);
        sk = block_sum(sk);
        const float rq = 1.0f / sqrtf(sq + 1e-6f), rk = 1.0f / sqrtf(sk + 1e-6f);
        for (int i = tid; i < dk; i += GDN_THREADS) {
            qs[i] = qs[i] * rq * q_scale;
            ks[i] = ks[i] * rk;
        }
        __syncthreads();
        const float b = sigmoidf_(beta[(size_t)t * hv + j]);
        float decay = 1.0f;
        if (!per_channel) {
            const float x = g[(size_t)t * hv + j] + dt_bias[j];
            decay = expf(a[j] * (x > 20.0f ? x : log1pf(expf(x))));
        }
        const float* vr = v + (size_t)t * ts + j * dv;
        float o[GDN_COLS];
        float ss = 0.0f;
#pragma unroll
        for (int u = 0; u < GDN_COLS; u++) {
            const int c = tid + u * GDN_THREADS;
            o[u] = 0.0f;
            if (c >= dv) continue;
            float kvs = 0.0f;
            for (int i = 0; i < dk; i++) {
                const float s = S[(size_t)i * dv + c] * (per_channel ? dec[i] : decay);
                S[(size_t)i * dv + c] = s;
                kvs += ks[i] * s;
            }
            const float delta = b * (vr[c] - kvs);
            float acc = 0.0f;
            for (int i = 0; i < dk; i++) {
                const float s = S[(size_t)i * dv + c] + ks[i] * delta;
                S[(size_t)i * dv + c] = s;
                acc += qs[i] * s;
            }
            o[u] = acc;
            ss += acc * acc;
        }
        ss = block_sum(ss);
        const float r = 1.0f / sqrtf(ss / (float)dv + eps);
        const size_t ob = ((size_t)t * hv + j) * dv;
#pragma unroll
        for (int u = 0; u < GDN_COLS; u++) {
            const int c = tid + u * GDN_THREADS;
            if (c >= dv) continue;
            const float zz = z[ob + c];
            out[ob + c] = o[u] * r * norm[c] * (gate_sigmoid ? sigmoidf_(zz) : silu_f(zz));
        }
        // qs / ks / dec are rewritten by the next token (block_sum's barriers order the rest).
        __syncthreads();
    }
    __syncthreads();
    for (int i = tid; i < dk * dv; i += GDN_THREADS) sg[i] = S[i];
}

// NEOX rotation of the first n_rot dims of x (pairs i, i + n_rot / 2) by p * inv_freq.
__device__ __forceinline__ void rope_first(float* x, int p, const float* inv_freq, int n_rot) {
    const int half = n_rot >> 1;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const float a = x[i], b = x[i + half];
        double sn, cs;
        sincos((double)((float)p * inv_freq[i]), &sn, &cs);
        const float c = (float)cs, s = (float)sn;
        x[i] = a * c - b * s;
        x[i + half] = a * s + b * c;
    }
}

// QSA's per-head preparation (grid n x (nh + nkv + ih + 1); qsa::qsa): query head h of the
// per-head interleaved [q | gate] rows qg (2 hd each) into q (RMS norm by qn, RoPE on the
// first n_rot dims) and gate; key head into k in place (kn, RoPE); indexer query head in
// place (iqn, RoPE); the last block stores the token's raw indexer key (no norm, no RoPE)
// to keys[pos].
extern "C" __global__ void qsa_prep(const float* __restrict__ qg, float* __restrict__ q,
                                    float* __restrict__ gate, float* __restrict__ k,
                                    float* __restrict__ iq, const float* __restrict__ ik,
                                    float* __restrict__ keys, const float* __restrict__ qn,
                                    const float* __restrict__ kn, const float* __restrict__ iqn,
                                    const int* __restrict__ pos,
                                    const float* __restrict__ inv_freq, int nh, int nkv, int hd,
                                    int ih, int id, int n_rot, float eps) {
    const int t = blockIdx.x, h = blockIdx.y, p = pos[t];
    float* x;
    const float* nw;
    int dim = hd;
    if (h < nh) {
        const float* src = qg + ((size_t)t * nh + h) * 2 * hd;
        x = q + ((size_t)t * nh + h) * hd;
        float* gh = gate + ((size_t)t * nh + h) * hd;
        for (int i = threadIdx.x; i < hd; i += blockDim.x) {
            x[i] = src[i];
            gh[i] = src[hd + i];
        }
        nw = qn;
    } else if (h < nh + nkv) {
        x = k + ((size_t)t * nkv + (h - nh)) * hd;
        nw = kn;
    } else if (h < nh + nkv + ih) {
        x = iq + ((size_t)t * ih + (h - nh - nkv)) * id;
        nw = iqn;
        dim = id;
    } else {
        for (int i = threadIdx.x; i < id; i += blockDim.x)
            keys[(size_t)p * id + i] = ik[(size_t)t * id + i];
        return;
    }
    const float s = rms_inv(x, dim, eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) x[i] = x[i] * s * nw[i];
    __syncthreads();
    rope_first(x, p, inv_freq, n_rot);
}

// QSA's pooled key of the block each token completes (grid n; tokens with (p + 1) % ratio
// != 0 do nothing): the mean of the block's raw keys (summed in position order, then
// divided by ratio), RMS-normed by `norm`, RoPE at the block's first position, into
// pooled[p / ratio].
extern "C" __global__ void qsa_pool(const float* __restrict__ keys, float* __restrict__ pooled,
                                    const float* __restrict__ norm, const int* __restrict__ pos,
                                    const float* __restrict__ inv_freq, int id, int ratio,
                                    int n_rot, float eps) {
    const int p = pos[blockIdx.x];
    if ((p + 1) % ratio != 0) return;
    const int start = p + 1 - ratio;
    float* out = pooled + (size_t)(p / ratio) * id;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < id; i += blockDim.x) {
        float a = 0.0f;
        for (int j = start; j <= p; j++) a += keys[(size_t)j * id + i];
        a /= (float)ratio;
        out[i] = a;
        ss += a * a;
    }
    ss = block_sum(ss);
    const float s = rsqrtf(ss / (float)id + eps);
    for (int i = threadIdx.x; i < id; i += blockDim.x) out[i] = out[i] * s * norm[i];
    __syncthreads();
    rope_first(out, start, inv_freq, n_rot);
}

// The positions a token attends to from its indexer's chosen blocks (grid n; QSA, and
// GLM-5.3-Flash's pools): the tokens of the blocks bsel[t * kb ..] (nb[t] of them,
// ascending), then, when `tail`, the incomplete block's (p + 1) / ratio * ratio ..= p, into
// psel[t * kp ..], their count into np[t].
extern "C" __global__ void qsa_expand(const int* __restrict__ bsel, const int* __restrict__ nb,
                                      const int* __restrict__ pos, int* __restrict__ psel,
                                      int* __restrict__ np, int ratio, int kb, int kp, int tail) {
    const int t = blockIdx.x, p = pos[t];
    const int nbk = nb[t];
    const int* bs = bsel + (size_t)t * kb;
    int* out = psel + (size_t)t * kp;
    for (int i = threadIdx.x; i < nbk * ratio; i += blockDim.x)
        out[i] = bs[i / ratio] * ratio + i % ratio;
    const int tail0 = tail ? (p + 1) / ratio * ratio : p + 1;
    for (int i = threadIdx.x; tail0 + i <= p; i += blockDim.x) out[nbk * ratio + i] = tail0 + i;
    if (threadIdx.x == 0) np[t] = nbk * ratio + (p + 1 - tail0);
}

// out[i] = x[rows[i]] (grid rows x blocks of the columns, `cols` values each).
extern "C" __global__ void rows_gather(const float* __restrict__ x, const int* __restrict__ rows,
                                       float* __restrict__ out, int cols) {
    const float* src = x + (size_t)rows[blockIdx.x] * cols;
    const int i = blockIdx.y * blockDim.x + threadIdx.x;
    if (i < cols) out[(size_t)blockIdx.x * cols + i] = src[i];
}

// y[t][r] = w[r] . x[t] for a few long f32 rows (grid n x rows; a block per product, each
// thread summing columns i = tid, tid + blockDim, .. in order, then block_sum): a low-rank
// mixer's injection, DeltaNet's beta and alpha, the shared expert's gate.
extern "C" __global__ void dot_rows_f32(const float* __restrict__ w, const float* __restrict__ x,
                                        float* __restrict__ y, int rows, int cols) {
    const int t = blockIdx.x, r = blockIdx.y;
    const float* wr = w + (size_t)r * cols;
    const float* xt = x + (size_t)t * cols;
    float d = 0.0f;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) d += wr[i] * xt[i];
    d = block_sum(d);
    if (threadIdx.x == 0) y[(size_t)t * rows + r] = d;
}
