//! Streamable tensor groups: the one description of every tensor group that may live
//! outside RAM.
//!
//! Owns: [`UnitGroup`] (routed experts: per layer, N units of any number of matrices,
//! each matrix a stacked tensor whose unit `u` is a contiguous slice; per-matrix types and
//! sizes may differ) and [`RowTable`] (a table read by row ranges, e.g. a per-layer
//! embedding table), gathered in [`StreamableGroups`]. The model loader builds it; the
//! streaming source, the resident-weight lock, measure mode, statistics and routing
//! traces all read it, so nothing downstream assumes a particular set of matrices.

use std::ops::Range;

/// One matrix of every unit of a layer: unit `u` occupies
/// `start + u * stride .. + bytes_per_unit` in the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StackedPart {
    /// Tensor name (for messages).
    pub name: String,
    /// Absolute file offset of unit 0's slice.
    pub start: u64,
    /// Bytes between consecutive units' slices (`bytes_per_unit` unless the matrix shares
    /// each unit's slice of its tensor with another, e.g. a merged gate_up tensor).
    pub stride: u64,
    /// Bytes of one unit's slice.
    pub bytes_per_unit: u64,
}

/// The units (routed experts) of one layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnitLayer {
    pub n_units: usize,
    /// The matrices every unit is made of, in the order the architecture's block reads them.
    pub parts: Vec<StackedPart>,
}

impl UnitLayer {
    /// File range of `part` of unit `u`.
    pub fn part_range(&self, part: usize, u: usize) -> Range<u64> {
        let p = &self.parts[part];
        let start = p.start + u as u64 * p.stride;
        start..start + p.bytes_per_unit
    }

    /// Bytes of one unit (all its matrices, no alignment).
    pub fn unit_bytes(&self) -> u64 {
        self.parts.iter().map(|p| p.bytes_per_unit).sum()
    }

    /// File ranges of every matrix of this layer (all units).
    pub fn ranges(&self) -> impl Iterator<Item = Range<u64>> + '_ {
        self.parts.iter().map(|p| match self.n_units as u64 {
            0 => p.start..p.start,
            n => p.start..p.start + p.stride * (n - 1) + p.bytes_per_unit,
        })
    }
}

/// Routed experts: one entry per layer, `None` for layers without routed units.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UnitGroup {
    pub layers: Vec<Option<UnitLayer>>,
}

impl UnitGroup {
    /// Bytes of all units of all layers.
    pub fn total_bytes(&self) -> u64 {
        self.layers
            .iter()
            .flatten()
            .map(|l| l.unit_bytes() * l.n_units as u64)
            .sum()
    }

    /// Bytes of one unit per layer (0 where the layer has none).
    pub fn unit_bytes_per_layer(&self) -> Vec<u64> {
        self.layers
            .iter()
            .map(|l| l.as_ref().map_or(0, UnitLayer::unit_bytes))
            .collect()
    }

    /// Whether any layer has units.
    pub fn is_empty(&self) -> bool {
        self.layers.iter().all(Option::is_none)
    }
}

/// A table read by rows (row `r` at `start + r * row_bytes`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowTable {
    pub name: String,
    pub start: u64,
    pub row_bytes: u64,
    pub n_rows: u64,
}

impl RowTable {
    pub fn range(&self) -> Range<u64> {
        self.start..self.start + self.row_bytes * self.n_rows
    }
}

/// Every tensor group of a model that may stay outside RAM.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StreamableGroups {
    /// Routed experts (streamed through the expert cache with `--expert-cache`).
    pub experts: UnitGroup,
    /// Row tables (left on disk and gathered by rows).
    pub row_tables: Vec<RowTable>,
}

impl StreamableGroups {
    /// File ranges of the routed experts.
    pub fn expert_ranges(&self) -> Vec<Range<u64>> {
        self.experts
            .layers
            .iter()
            .flatten()
            .flat_map(UnitLayer::ranges)
            .collect()
    }

    /// File ranges of every group (experts and row tables), sorted by start.
    pub fn all_ranges(&self) -> Vec<Range<u64>> {
        let mut v = self.expert_ranges();
        v.extend(self.row_tables.iter().map(RowTable::range));
        v.sort_by_key(|r| r.start);
        v
    }

    /// The complement of [`Self::all_ranges`] within `data_start..file_size`: what must
    /// be resident (and is worth locking) when the groups stream.
    pub fn resident_ranges(&self, data_start: u64, file_size: u64) -> Vec<Range<u64>> {
        let mut out = Vec::new();
        let mut pos = data_start;
        for r in self.all_ranges() {
            if r.start > pos {
                out.push(pos..r.start);
            }
            pos = pos.max(r.end);
        }
        if pos < file_size {
            out.push(pos..file_size);
        }
        out
    }

    /// Bytes of every group together.
    pub fn total_bytes(&self) -> u64 {
        self.experts.total_bytes()
            + self
                .row_tables
                .iter()
                .map(|t| t.row_bytes * t.n_rows)
                .sum::<u64>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layer(start: u64) -> UnitLayer {
        UnitLayer {
            n_units: 4,
            parts: vec![
                StackedPart {
                    name: "a".into(),
                    start,
                    stride: 10,
                    bytes_per_unit: 10,
                },
                StackedPart {
                    name: "b".into(),
                    start: start + 40,
                    stride: 5,
                    bytes_per_unit: 5,
                },
            ],
        }
    }

    #[test]
    fn ranges_and_complement() {
        let g = StreamableGroups {
            experts: UnitGroup {
                layers: vec![None, Some(layer(100))],
            },
            row_tables: vec![RowTable {
                name: "ple".into(),
                start: 300,
                row_bytes: 8,
                n_rows: 10,
            }],
        };
        assert_eq!(
            g.experts.layers[1].as_ref().unwrap().part_range(1, 2),
            150..155
        );
        assert_eq!(g.experts.total_bytes(), 60);
        assert_eq!(g.experts.unit_bytes_per_layer(), vec![0, 15]);
        assert_eq!(g.all_ranges(), vec![100..140, 140..160, 300..380]);
        assert_eq!(
            g.resident_ranges(50, 400),
            vec![50..100, 160..300, 380..400]
        );
        assert_eq!(g.total_bytes(), 140);
    }
}
