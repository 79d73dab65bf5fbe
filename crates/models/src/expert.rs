//! The resident expert source: routed experts served straight from the memory map.
//!
//! Owns: [`ResidentExperts`], the [`ExpertSource`] used when experts do not stream (the
//! OS pages them in and out like any mapped tensor). It slices each unit's matrices out
//! of the mapped file using the same [`UnitGroup`] the streaming tier reads.

use sluice_tier::{BatchFn, ExpertSource, ExpertView, Stop, StreamError, UnitGroup, MAX_PARTS};

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

impl ResidentExperts {
    fn view<'m>(&self, mapped: &'m [u8], layer: usize, e: usize) -> Option<ExpertView<'m>> {
        let l = self.group.layers.get(layer)?.as_ref()?;
        let mut parts: [&[u8]; MAX_PARTS] = [&[]; MAX_PARTS];
        for (p, slot) in parts.iter_mut().enumerate().take(l.parts.len()) {
            let r = l.part_range(p, e);
            *slot = &mapped[r.start as usize..r.end as usize];
        }
        Some(ExpertView::new(&parts[..l.parts.len()]))
    }
}

impl ExpertSource for ResidentExperts {
    /// Every unit is ready: one batch.
    fn for_each_batch(
        &self,
        mapped: &[u8],
        layer: usize,
        units: &[usize],
        f: &mut BatchFn<'_>,
    ) -> Result<(), StreamError> {
        let views: Vec<(usize, ExpertView<'_>)> = units
            .iter()
            .enumerate()
            .filter_map(|(i, &e)| self.view(mapped, layer, e).map(|v| (i, v)))
            .collect();
        if views.is_empty() {
            return Ok(());
        }
        f(&views).map_err(|Stop| StreamError::Stopped)
    }

    fn for_each_expert(
        &self,
        mapped: &[u8],
        layer: usize,
        units: &[usize],
        f: &mut dyn FnMut(usize, ExpertView<'_>) -> Result<(), Stop>,
    ) -> Result<(), StreamError> {
        for (i, &e) in units.iter().enumerate() {
            let Some(v) = self.view(mapped, layer, e) else {
                return Ok(());
            };
            f(i, v).map_err(|Stop| StreamError::Stopped)?;
        }
        Ok(())
    }
}
