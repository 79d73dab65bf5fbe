//! Read-only memory maps of model files.

use std::fs::File;
use std::path::{Path, PathBuf};

/// Why a file could not be mapped.
#[derive(Debug, thiserror::Error)]
pub enum MapError {
    #[error("{path}: cannot open: {source}")]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: cannot map: {source}")]
    Map {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// A whole file mapped read-only. An empty file maps to an empty slice.
pub struct MappedFile {
    path: PathBuf,
    map: Option<memmap2::Mmap>,
}

impl MappedFile {
    /// Map `path` read-only.
    pub fn open(path: &Path) -> Result<MappedFile, MapError> {
        let file = File::open(path).map_err(|source| MapError::Open {
            path: path.to_path_buf(),
            source,
        })?;
        let len = file
            .metadata()
            .map_err(|source| MapError::Open {
                path: path.to_path_buf(),
                source,
            })?
            .len();
        if len == 0 {
            return Ok(MappedFile {
                path: path.to_path_buf(),
                map: None,
            });
        }
        // SAFETY: the map is read-only and private to this process. Model files are not
        // expected to change while sluice runs; if another process truncates the file,
        // access past the new end raises SIGBUS, which is the documented hazard of every
        // mmap-based model loader (llama.cpp included). Callers validate offsets against
        // the length seen here before touching bytes.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|source| MapError::Map {
            path: path.to_path_buf(),
            source,
        })?;
        Ok(MappedFile {
            path: path.to_path_buf(),
            map: Some(map),
        })
    }

    /// The mapped bytes.
    pub fn bytes(&self) -> &[u8] {
        self.map.as_deref().unwrap_or(&[])
    }

    /// The file this map was made from.
    pub fn path(&self) -> &Path {
        &self.path
    }
}
