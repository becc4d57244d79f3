// The body of cache_attention.cpp's kernel, written once over a vector type and included once per instruction
// set, each time inside a namespace that defines `Ops` (the vector operations and the tile sizes of that set) and
// under that set's `#pragma GCC target`. No includes here: cache_attention.cpp includes everything first.
//
// Ops gives: kLanes (W), the vector type V, zero, set1, load, store, fma (a b + c, one rounding), add, max, exp2,
// first (lane 0), reduce_add (a fixed order) and reduce_max, hide (-inf outside a range of lanes), widen (n float16
// to float32, n a multiple of W); for the scores, each in an order of the set's own that the other rows and keys do
// not change: pack_keys (W float16 keys to the set's layout), score (kScoreRows query rows against W packed keys),
// score_direct (the same scores of W float16 keys read as they lie); kValueRows (rows of a tile for the values
// product) and kValueColumns (vectors of D a pass of it takes); kDirectRows (the most rows of a unit that reads its
// keys directly rather than packed).

// The softmax state of one query row within a unit's segment: its running maximum, the lanes of its running sum of
// exponentials and its unnormalised output (D).
struct RowState {
  float* max;     // (rows)
  float* total;   // (rows, W)
  float* out;     // (rows, D)
};

// keys (kBlock, D): the block's key vectors (W keys each) that hold one of its keys [ja, jb) (rows row_stride
// apart), packed (Ops::pack_keys) at keys + vector D; only the vectors [ja, jb) does not fill, with `edges_only`.
// A vector's keys outside [ja, jb) are 0 (their scores are hidden).
inline void pack_block_keys(const at::Half* block, int64_t row_stride, int64_t ja, int64_t jb, int64_t dim,
                            float* keys, bool edges_only) {
  constexpr int64_t W = Ops::kLanes;
  for (int64_t vector = ja / W * W; vector < jb; vector += W) {
    if (vector >= ja && vector + W <= jb) {
      if (!edges_only) Ops::pack_keys(block + vector * row_stride, row_stride, dim, keys + vector * dim);
      continue;
    }
    at::Half edge[W * kMaxDim];  // W > 1: a vector body, dim <= kMaxDim
    for (int64_t j = 0; j < W; ++j) {
      const bool read = vector + j >= ja && vector + j < jb;
      for (int64_t d = 0; d < dim; ++d) edge[j * dim + d] = read ? block[(vector + j) * row_stride + d] : at::Half(0.f);
    }
    Ops::pack_keys(edge, dim, dim, keys + vector * dim);
  }
}

// scores (rows, kBlock) = q (rows, D) . keys^T for the key vectors [k0, k1) of the block: from the packed keys, or,
// with `block` (not null), the vectors that [ja, jb) fills from the block's float16 rows (row_stride apart)
// directly; tiles of Ops::kScoreRows rows against one vector. Every score is Ops::score's fixed order, a row's alone,
// whatever the tile.
template <int kDim, int R = Ops::kScoreRows, class ReadAhead = Stream>
inline void score_rows(int64_t rows, const float* q, int64_t dim, const float* keys, const at::Half* block,
                       int64_t row_stride, int64_t ja, int64_t jb, int64_t k0, int64_t k1, float* scores,
                       ReadAhead& stream) {
  constexpr int64_t W = Ops::kLanes;
  const int64_t d_end = kDim ? kDim : dim;
  int64_t r = 0;
  for (; r + R <= rows; r += R)
    for (int64_t vector = k0 * W; vector < k1 * W; vector += W) {
      if (block && vector >= ja && vector + W <= jb)
        Ops::template score_direct<kDim, R>(q + r * d_end, block + vector * row_stride, row_stride, dim,
                                            scores + r * kBlock + vector);
      else
        Ops::template score<kDim, R>(q + r * d_end, keys + vector * d_end, dim, scores + r * kBlock + vector);
      stream.advance(Stream::kScoreUnits);
    }
  if constexpr (R > 1) {
    if (r < rows)
      score_rows<kDim, R - 1, ReadAhead>(rows - r, q + r * d_end, dim, keys, block, row_stride, ja, jb, k0, k1,
                                         scores + r * kBlock, stream);
  }
}

// state.out (rows, D) = state.out rescale + weights (rows, keys [j0, j1)) . values (keys, D), float16 rows `stride`
// apart widened as they are read (every value tile reads them: cheaper than widening them once into memory and
// reading that back): each output element's block sum is the FMA chain over the keys in order from 0, then added to
// the rescaled old value in one FMA. The read-ahead advances by one a key.
template <int kDim, int R, class ReadAhead>
inline void value_tile(const float* weights, const at::Half* values, int64_t stride, int64_t dim, int64_t j0, int64_t j1,
                       const float* rescale, float* out, ReadAhead& stream) {
  constexpr int kColumns = Ops::kValueColumns;
  const int64_t d_end = kDim ? kDim : dim;
  for (int64_t column = 0; column < d_end; column += kColumns * Ops::kLanes) {
    const int64_t count = std::min<int64_t>(kColumns, (d_end - column) / Ops::kLanes);
    typename Ops::V acc[R][kColumns];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < kColumns; ++c) acc[r][c] = Ops::zero();
    if (count == kColumns) {
      for (int64_t j = j0; j < j1; ++j) {
        if (column == 0) stream.advance(1);
        typename Ops::V value[kColumns];
        for (int c = 0; c < kColumns; ++c) value[c] = Ops::load(values + j * stride + column + c * Ops::kLanes);
        for (int r = 0; r < R; ++r) {
          const typename Ops::V w = Ops::set1(weights[r * kBlock + j]);
          for (int c = 0; c < kColumns; ++c) acc[r][c] = Ops::fma(w, value[c], acc[r][c]);
        }
      }
    } else {
      for (int64_t j = j0; j < j1; ++j) {
        for (int c = 0; c < count; ++c) {
          const typename Ops::V value = Ops::load(values + j * stride + column + c * Ops::kLanes);
          for (int r = 0; r < R; ++r) acc[r][c] = Ops::fma(Ops::set1(weights[r * kBlock + j]), value, acc[r][c]);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < count; ++c) {
        float* at = out + r * d_end + column + c * Ops::kLanes;
        Ops::store(at, Ops::fma(Ops::load(at), Ops::set1(rescale[r]), acc[r][c]));
      }
  }
}

template <int kDim, int R = Ops::kValueRows, class ReadAhead = Stream>
inline void value_rows(int64_t rows, const float* weights, const at::Half* values, int64_t stride, int64_t dim, int64_t j0,
                       int64_t j1, const float* rescale, float* out, ReadAhead& stream) {
  const int64_t d_end = kDim ? kDim : dim;
  int64_t r = 0;
  for (; r + R <= rows; r += R)
    value_tile<kDim, R, ReadAhead>(weights + r * kBlock, values, stride, dim, j0, j1, rescale + r, out + r * d_end,
                                   stream);
  if constexpr (R > 1) {
    if (r < rows)
      value_rows<kDim, R - 1, ReadAhead>(rows - r, weights + r * kBlock, values, stride, dim, j0, j1, rescale + r,
                                            out + r * d_end, stream);
  }
}

// Row `row`'s online-softmax step over one block: s holds its scores of the key vectors [k0, k1), of which it reads
// the lanes [lo, hi] (the others hidden); s becomes its weights 2^(score - m) for its new running maximum m, their
// sum goes lane-wise into its running sum, and rescale[row] is the factor its output so far is scaled by.
inline void block_weights(float* s, int64_t k0, int64_t k1, int64_t lo, int64_t hi, int64_t row, RowState state,
                          float* rescale) {
  constexpr int64_t W = Ops::kLanes;
  typename Ops::V top = Ops::set1(kMinusInf);
  for (int64_t k = k0; k < k1; ++k) {
    typename Ops::V score = Ops::load(s + k * W);
    if (k * W < lo || k * W + W - 1 > hi) {  // a vector the row reads in part or not at all
      score = Ops::hide(score, k * W, lo, hi);
      Ops::store(s + k * W, score);
    }
    top = Ops::max(top, score);
  }
  const float old_max = state.max[row];
  const float new_max = std::max(old_max, Ops::reduce_max(top));
  const float shift = new_max == kMinusInf ? 0.f : new_max;  // no key read yet: every weight 0
  const typename Ops::V shift_v = Ops::set1(shift);
  typename Ops::V block_total = Ops::zero();
  for (int64_t k = k0; k < k1; ++k) {
    const typename Ops::V w = Ops::exp2(Ops::sub(Ops::load(s + k * W), shift_v));
    Ops::store(s + k * W, w);
    block_total = Ops::add(block_total, w);
  }
  // 2^0 is 1 exactly: an unchanged maximum needs no exp2
  rescale[row] = old_max == new_max && shift == new_max ? 1.f : Ops::first(Ops::exp2(Ops::set1(old_max - shift)));
  state.max[row] = new_max;
  float* total = state.total + row * W;
  Ops::store(total, Ops::fma(Ops::load(total), Ops::set1(rescale[row]), block_total));
}

// The blocks [begin, end) of a unit of a few rows that reads its keys directly, every row reading every key of each:
// attend_rows's step for each block, but with no read-ahead. The rows of a verification that fit one score tile (2
// tokens of 3 grouped heads) take this for all their blocks but the last (its own keys, which its first rows do not
// read): over 7,168 and 32,768 keys from memory on two threads, their attention took 0.94x the time it takes with
// the read-ahead. A decode step's, bound by its read, and one of two tiles, which reads each block twice, keep it
// (without it: 1.03-1.14x and 1.08x the time).
template <int kDim>
__attribute__((noinline)) void whole_blocks(const Problem& p, const float* q, const at::Half* k_head,
                                            const at::Half* v_head, int64_t rows, int64_t begin, int64_t end,
                                            float* weights, float* rescale, RowState state) {
  const int64_t dim = kDim ? kDim : p.dim;
  constexpr int64_t vectors = kBlock / Ops::kLanes;
  NoReadAhead none;
  for (int64_t block_start = begin; block_start < end; block_start += kBlock) {
    score_rows<kDim, Ops::kScoreRows, NoReadAhead>(rows, q, dim, nullptr, k_head + block_start * p.k_row, p.k_row,
                                                   0, kBlock, 0, vectors, weights, none);
    for (int64_t row = 0; row < rows; ++row)
      block_weights(weights + row * kBlock, 0, vectors, 0, kBlock - 1, row, state, rescale);
    value_rows<kDim, Ops::kValueRows, NoReadAhead>(rows, weights, v_head + block_start * p.v_row, p.v_row, dim, 0,
                                                   kBlock, rescale, state.out, none);
  }
}

// One unit of work: the rows [row0, row0 + rows) of KV head `head` against the keys of segment `segment`, online
// softmax over its blocks in increasing position; the rows' (maximum, sum, output) go to the problem's partials.
// kPacked: the keys packed once for many rows, else read as float16 directly (a function of its own, so that a
// decode step's loop is compiled as if the other did not exist); the values are read as float16 either way.
template <int kDim, bool kPacked>
void attend_rows(const Problem& p, int64_t head, int64_t row0, int64_t rows, int64_t segment, float* scratch) {
  const int64_t dim = kDim ? kDim : p.dim;
  constexpr int64_t W = Ops::kLanes;
  float* keys = scratch;                      // (kBlock, D)
  float* weights = keys + kBlock * dim;       // (rows, kBlock)
  float* rescale = weights + rows * kBlock;   // (rows)
  RowState state{rescale + rows, rescale + 2 * rows, rescale + 2 * rows + rows * W};
  std::fill(state.max, state.max + rows, kMinusInf);
  std::fill(state.total, state.total + rows * W, 0.f);
  std::fill(state.out, state.out + rows * dim, 0.f);

  // the keys the segment holds, as view indices; the part of them any of these rows reads, [first, last], and the
  // part every one of them reads, [every_first, every_last]
  const int64_t seg_begin = p.segment_begin(segment), seg_end = p.segment_end(segment);
  int64_t first = seg_end, last = seg_begin - 1, every_first = seg_begin, every_last = seg_end - 1;
  for (int64_t r = row0; r < row0 + rows; ++r) {
    const int64_t row_first = p.first_key(r), row_last = p.last_key(r);
    first = std::min(first, row_first);
    last = std::max(last, row_last);
    every_first = std::max(every_first, row_first);
    every_last = std::min(every_last, row_last);
  }
  first = std::max(first, seg_begin);
  last = std::min(last, seg_end - 1);
  const float* q = p.q + (head * p.rows + row0) * dim;
  const at::Half* k_head = p.k + head * p.k_head;
  const at::Half* v_head = p.v + head * p.v_head;
  // a verification of one score tile: the whole blocks of [every_first, every_last] go to whole_blocks
  int64_t whole_begin = seg_begin, whole_end = seg_begin;
  if (!kPacked && rows > p.group && rows <= Ops::kScoreRows) {
    whole_begin = floor_to(p.origin + every_first + kBlock - 1, kBlock) - p.origin;
    whole_end = floor_to(p.origin + every_last + 1, kBlock) - p.origin;
  }
  if (first <= last) {
    for (int64_t block_start = floor_to(p.origin + first, kBlock) - p.origin; block_start <= last;
         block_start += kBlock) {
      if (block_start == whole_begin && whole_begin < whole_end) {
        whole_blocks<kDim>(p, q, k_head, v_head, rows, whole_begin, whole_end, weights, rescale, state);
        block_start = whole_end - kBlock;
        continue;
      }
      // the block's keys that are read, [ja, jb) as block lanes
      const int64_t ja = std::max(block_start, first) - block_start;
      const int64_t jb = std::min(block_start + kBlock, last + 1) - block_start;
      const at::Half* k_block = k_head + block_start * p.k_row;
      // the unit reads the next block while it works on this one: its work, counted as the stream counts it, were
      // every tile to read every key of [ja, jb)
      Stream stream;
      const int64_t next = block_start + kBlock;
      if (next < p.keys) {
        const int64_t vectors = (jb + W - 1) / W - ja / W;
        int64_t units = 0;
        for (int64_t t0 = 0; t0 < rows; t0 += kTileRows) {
          const int64_t tile = std::min(kTileRows, rows - t0);
          units += (tile + Ops::kScoreRows - 1) / Ops::kScoreRows * vectors * Stream::kScoreUnits +
                   (tile + Ops::kValueRows - 1) / Ops::kValueRows * (jb - ja);
        }
        // a unit that reads its keys directly (a decode step's) also asks for the block kFarBlocks ahead into L2; a
        // packed unit's block of many rows takes long enough for the next block alone
        const int64_t far = block_start + Stream::kFarBlocks * kBlock;
        const int64_t far_keys = !kPacked && far < p.keys ? std::min(kBlock, p.keys - far) : 0;
        stream = Stream(k_head + next * p.k_row, v_head + next * p.v_row, p.k_row, p.v_row,
                        std::min(kBlock, p.keys - next), dim, units, far_keys);
      }
      pack_block_keys(k_block, p.k_row, ja, jb, dim, keys, !kPacked);
      for (int64_t t0 = 0; t0 < rows; t0 += kTileRows) {
        const int64_t tile = std::min(kTileRows, rows - t0);
        // the lanes each row of the tile reads, [lo, hi]; the tile's union
        int64_t tile_lo = kBlock, tile_hi = -1;
        int64_t lo[kTileRows], hi[kTileRows];
        for (int64_t r = 0; r < tile; ++r) {
          lo[r] = std::max(p.first_key(row0 + t0 + r) - block_start, ja);
          hi[r] = std::min(p.last_key(row0 + t0 + r) - block_start, jb - 1);
          if (lo[r] <= hi[r]) {
            tile_lo = std::min(tile_lo, lo[r]);
            tile_hi = std::max(tile_hi, hi[r]);
          }
        }
        if (tile_lo > tile_hi) continue;  // no row of the tile reads a key of the block: nothing changes
        const int64_t k0 = tile_lo / W, k1 = tile_hi / W + 1;  // the key vectors the tile reads
        float* tile_weights = weights + t0 * kBlock;
        score_rows<kDim>(tile, q + t0 * dim, dim, keys, kPacked ? nullptr : k_block, p.k_row, ja, jb, k0, k1,
                         tile_weights, stream);
        for (int64_t r = 0; r < tile; ++r)
          block_weights(tile_weights + r * kBlock, k0, k1, lo[r], hi[r], t0 + r, state, rescale);
        value_rows<kDim>(tile, tile_weights, v_head + block_start * p.v_row, p.v_row, dim, tile_lo, tile_hi + 1,
                         rescale + t0, state.out + t0 * dim, stream);
      }
      stream.finish();
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* partial = p.partial(head, segment, row0 + r);
    partial[0] = state.max[r];
    partial[1] = Ops::reduce_add(Ops::load(state.total + r * W));
    std::copy(state.out + r * dim, state.out + (r + 1) * dim, partial + 2);
  }
}

// A group of up to Ops::kDirectRows rows (a decode step's grouped heads, a short verification's) reads the float16
// keys directly (but for the keys of vectors the rows read in part); larger ones (a prefill chunk's) pack them once
// for all.
template <int kDim>
void attend_unit(const Problem& p, int64_t head, int64_t row0, int64_t rows, int64_t segment, float* scratch) {
  if (rows > Ops::kDirectRows)
    attend_rows<kDim, true>(p, head, row0, rows, segment, scratch);
  else
    attend_rows<kDim, false>(p, head, row0, rows, segment, scratch);
}

inline int64_t unit_scratch(int64_t dim) {
  return dim * kBlock + kGroupRows * (kBlock + 2 + Ops::kLanes + dim);
}

// Row r of KV head `head`: its segments' partials merged in segment order into out (D): with M the largest
// maximum, out = sum_s 2^(m_s - M) o_s / sum_s 2^(m_s - M) l_s (base-2 scores).
template <int kDim>
void combine_row(const Problem& p, int64_t head, int64_t r, float* out) {
  const int64_t dim = kDim ? kDim : p.dim;
  const int64_t first = p.segment_of(p.origin + p.first_key(r)), last = p.segment_of(p.origin + p.last_key(r));
  float top = kMinusInf;
  for (int64_t s = first; s <= last; ++s) top = std::max(top, p.partial(head, s, r)[0]);
  float total = 0.f;
  for (int64_t d = 0; d < dim; d += Ops::kLanes) Ops::store(out + d, Ops::zero());
  for (int64_t s = first; s <= last; ++s) {
    const float* partial = p.partial(head, s, r);
    const float factor = Ops::first(Ops::exp2(Ops::set1(partial[0] - top)));
    total = std::fma(factor, partial[1], total);
    const typename Ops::V f = Ops::set1(factor);
    for (int64_t d = 0; d < dim; d += Ops::kLanes)
      Ops::store(out + d, Ops::fma(f, Ops::load(partial + 2 + d), Ops::load(out + d)));
  }
  const typename Ops::V divisor = Ops::set1(total);
  for (int64_t d = 0; d < dim; d += Ops::kLanes) Ops::store(out + d, Ops::div(Ops::load(out + d), divisor));
}

inline Body body(int64_t dim) {
  if (dim == 64) return Body{attend_unit<64>, combine_row<64>, unit_scratch};
  if (dim == 128) return Body{attend_unit<128>, combine_row<128>, unit_scratch};
  return Body{attend_unit<0>, combine_row<0>, unit_scratch};
}
