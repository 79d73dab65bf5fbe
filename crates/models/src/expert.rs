//! The resident expert source: routed experts served straight from the memory map.
//!
//! Owns: [`ResidentExperts`], the [`ExpertSource`] used when experts do not stream (the
//! OS pages them in and out like any mapped tensor). It slices each unit's matrices out
//! of the mapped file using the same [`UnitGroup`] the streaming tier reads.

use sluice_tier::{ExpertSource, ExpertView, Stop, StreamError, UnitGroup, MAX_PARTS};

/// Serves experts from the memory-mapped model file.
#[derive(Debug, Default)]
pub struct ResidentExperts {
    group: UnitGroup,
}

impl ResidentExperts {
    pub fn new(group: UnitGroup) -> ResidentExperts {
        ResidentExperts { group }
    }
}

impl ExpertSource for ResidentExperts {
    fn for_each_expert(
        &self,
        mapped: &[u8],
        layer: usize,
        units: &[usize],
        f: &mut dyn FnMut(usize, ExpertView<'_>) -> Result<(), Stop>,
    ) -> Result<(), StreamError> {
        let Some(l) = self.group.layers.get(layer).and_then(Option::as_ref) else {
            return Ok(());
        };
        for (i, &e) in units.iter().enumerate() {
            let mut parts: [&[u8]; MAX_PARTS] = [&[]; MAX_PARTS];
            for (p, slot) in parts.iter_mut().enumerate().take(l.parts.len()) {
                let r = l.part_range(p, e);
                *slot = &mapped[r.start as usize..r.end as usize];
            }
            f(i, ExpertView::new(&parts[..l.parts.len()])).map_err(|Stop| StreamError::Stopped)?;
        }
        Ok(())
    }
}
