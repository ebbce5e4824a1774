//! Hugging Face checkpoints as published: `model.safetensors`, or shards listed by
//! `model.safetensors.index.json`, memory-mapped. Tensors are handed out as f32 (the CPU
//! backend's compute type), converted from BF16/F16/F32, with their shape checked against what
//! the config implies. Every failure names the tensor or file.

use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

use crate::error::{EngineError, Result};

struct Entry {
    file: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    /// Byte range inside the file's data section.
    start: usize,
    end: usize,
}

pub struct Checkpoint {
    dir: PathBuf,
    files: Vec<(PathBuf, Mmap, usize)>,
    entries: HashMap<String, Entry>,
    used: Mutex<BTreeSet<String>>,
}

impl Checkpoint {
    pub fn open(dir: &Path) -> Result<Self> {
        let index = dir.join("model.safetensors.index.json");
        let shard_names: Vec<String> = if index.exists() {
            let text = std::fs::read_to_string(&index).map_err(|e| EngineError::io(&index, e))?;
            let v: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| EngineError::CorruptCheckpoint {
                    path: index.clone(),
                    message: format!("index is not valid JSON: {e}"),
                })?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| EngineError::CorruptCheckpoint {
                    path: index.clone(),
                    message: "index has no `weight_map` object".into(),
                })?;
            let set: BTreeSet<String> = map
                .values()
                .filter_map(|f| f.as_str().map(String::from))
                .collect();
            set.into_iter().collect()
        } else {
            let mut names: Vec<String> = std::fs::read_dir(dir)
                .map_err(|e| EngineError::io(dir, e))?
                .filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.ends_with(".safetensors"))
                .collect();
            names.sort();
            names
        };
        if shard_names.is_empty() {
            return Err(EngineError::MissingTensor {
                name: "(any)".into(),
                looked_in: format!("{}: no *.safetensors file", dir.display()),
            });
        }
        let mut files = Vec::new();
        let mut entries = HashMap::new();
        for (fi, name) in shard_names.iter().enumerate() {
            let path = dir.join(name);
            let file = File::open(&path).map_err(|e| EngineError::io(&path, e))?;
            // SAFETY: the checkpoint is opened read-only and treated as immutable while loaded;
            // a concurrent writer would be an operator error, as with every mmap-based loader.
            let mmap = unsafe { Mmap::map(&file) }.map_err(|e| EngineError::io(&path, e))?;
            let corrupt = |message: String| EngineError::CorruptCheckpoint {
                path: path.clone(),
                message,
            };
            // Full validation (header, offsets, file length) before trusting any offset.
            SafeTensors::deserialize(&mmap).map_err(|e| corrupt(e.to_string()))?;
            let (header_len, meta) =
                SafeTensors::read_metadata(&mmap).map_err(|e| corrupt(e.to_string()))?;
            let data_start = 8 + header_len;
            for (tname, info) in meta.tensors() {
                let (start, end) = info.data_offsets;
                entries.insert(
                    tname.clone(),
                    Entry {
                        file: fi,
                        dtype: info.dtype,
                        shape: info.shape.clone(),
                        start,
                        end,
                    },
                );
            }
            files.push((path, mmap, data_start));
        }
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            files,
            entries,
            used: Mutex::new(BTreeSet::new()),
        })
    }

    pub fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        self.entries.get(name).map(|e| e.shape.as_slice())
    }

    /// The first of `names` present in the checkpoint (for tensors with several spellings).
    pub fn resolve<'n>(&self, names: &[&'n str]) -> Result<&'n str> {
        names
            .iter()
            .copied()
            .find(|n| self.contains(n))
            .ok_or_else(|| EngineError::MissingTensor {
                name: names[0].to_string(),
                looked_in: if names.len() > 1 {
                    format!(
                        "{} (also tried {})",
                        self.dir.display(),
                        names[1..].join(", ")
                    )
                } else {
                    self.dir.display().to_string()
                },
            })
    }

    /// The entry of tensor `name`, or which tensor is missing where.
    fn lookup(&self, name: &str) -> Result<&Entry> {
        self.entries
            .get(name)
            .ok_or_else(|| EngineError::MissingTensor {
                name: name.to_string(),
                looked_in: self.dir.display().to_string(),
            })
    }

    /// The entry of tensor `name`, checked to exist with exactly `shape`.
    fn entry(&self, name: &str, shape: &[usize]) -> Result<&Entry> {
        let e = self.lookup(name)?;
        if e.shape != shape {
            return Err(EngineError::ShapeMismatch {
                name: name.to_string(),
                expected: shape.to_vec(),
                found: e.shape.clone(),
            });
        }
        Ok(e)
    }

    /// Tensor `name` as f32, checked to have exactly `shape`.
    pub fn f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let e = self.entry(name, shape)?;
        let out = self.convert(name, e)?;
        self.used.lock().unwrap().insert(name.to_string());
        Ok(out)
    }

    /// Tensor `name` as raw bytes, checked to be U8 of exactly `shape` (packed quantized weights
    /// and their scales).
    pub fn u8(&self, name: &str, shape: &[usize]) -> Result<Vec<u8>> {
        let e = self.entry(name, shape)?;
        let (path, mmap, data_start) = &self.files[e.file];
        if e.dtype != Dtype::U8 {
            return Err(EngineError::CorruptCheckpoint {
                path: path.clone(),
                message: format!(
                    "tensor `{name}` is {:?}; a packed tensor must be U8",
                    e.dtype
                ),
            });
        }
        let bytes = &mmap[data_start + e.start..data_start + e.end];
        if bytes.len() != shape.iter().product::<usize>() {
            return Err(EngineError::CorruptCheckpoint {
                path: path.clone(),
                message: format!(
                    "tensor `{name}` has {} bytes for shape {shape:?}",
                    bytes.len()
                ),
            });
        }
        self.used.lock().unwrap().insert(name.to_string());
        Ok(bytes.to_vec())
    }

    /// Tensor `name` as f32 with any shape of `numel` elements (for tensors whose published shape
    /// varies, such as `A_log`: `[1,1,H,1]` in Kimi Linear, `[H]` elsewhere).
    pub fn f32_numel(&self, name: &str, numel: usize) -> Result<(Vec<f32>, Vec<usize>)> {
        let e = self.lookup(name)?;
        if e.shape.iter().product::<usize>() != numel {
            return Err(EngineError::ShapeMismatch {
                name: name.to_string(),
                expected: vec![numel],
                found: e.shape.clone(),
            });
        }
        let out = self.convert(name, e)?;
        self.used.lock().unwrap().insert(name.to_string());
        Ok((out, e.shape.clone()))
    }

    fn convert(&self, name: &str, e: &Entry) -> Result<Vec<f32>> {
        let (path, mmap, data_start) = &self.files[e.file];
        let bytes = &mmap[data_start + e.start..data_start + e.end];
        let numel: usize = e.shape.iter().product();
        let elem = match e.dtype {
            Dtype::BF16 | Dtype::F16 => 2,
            Dtype::F32 => 4,
            other => {
                return Err(EngineError::UnsupportedDtype {
                    name: name.to_string(),
                    dtype: format!("{other:?}"),
                })
            }
        };
        if bytes.len() != numel * elem {
            return Err(EngineError::CorruptCheckpoint {
                path: path.clone(),
                message: format!(
                    "tensor `{name}` has {} bytes for {numel} elements",
                    bytes.len()
                ),
            });
        }
        Ok(match e.dtype {
            Dtype::BF16 => bytes
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            Dtype::F16 => bytes
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            _ => bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
        })
    }

    /// Tensors present in the files that the model never read.
    pub fn unused(&self) -> Vec<String> {
        let used = self.used.lock().unwrap();
        let mut v: Vec<String> = self
            .entries
            .keys()
            .filter(|k| !used.contains(*k))
            .cloned()
            .collect();
        v.sort();
        v
    }
}
