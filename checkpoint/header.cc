#include "checkpoint/header.h"

#include <algorithm>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "checkpoint/checkpoint.h"
#include "common/crc32c.h"
#include "common/status_macros.h"
#include "core/block8.h"

// Helpers not declared in header.h live in this namespace too (header.h
// names those that header_parse.cc shares).
namespace optimd {
namespace checkpoint_header {

const char* SafetensorsDType(DType d) {
  switch (d) {
    case DType::kFloat32:
      return "F32";
    case DType::kBFloat16:
      return "BF16";
    case DType::kFloat16:
      return "F16";
    case DType::kBlock8:  // the codes; their scales are an F32 entry
      return "U8";
    case DType::kFloat64:
      return "F64";
    case DType::kFloat8E4M3:
      return "F8_E4M3";
    case DType::kFloat8E5M2:
      return "F8_E5M2";
  }
  return "?";
}

// Every piece of the groups, in tensor order, without offsets or keys.
std::vector<Entry> Entries(const std::vector<Group*>& groups) {
  std::vector<Entry> out;
  for (uint32_t gi = 0; gi < groups.size(); ++gi) {
    for (const TensorEntry& t : groups[gi]->tensors) {
      const Layout& l = t.layout;
      const uint64_t n = t.numel;
      auto add = [&](const char* kind, absl::string_view suffix,
                     const char* dtype, uint64_t bytes, uint8_t* data) {
        Entry e;
        e.name = absl::StrCat(t.name, suffix);
        e.dtype = dtype;
        e.numel = n;
        e.bytes = bytes;
        e.data = data;
        e.group = gi;
        e.kind = kind;
        e.shape = t.shape;
        out.push_back(std::move(e));
      };
      add("param", "", SafetensorsDType(l.param_dtype),
          n * DTypeSize(l.param_dtype), t.param.data);
      if (l.fp8_recipe != Fp8Recipe::kNone && n > 0) {
        // The trainer's scale inverses beside its FP8 parameter: with them
        // a load restores the quantized weights exactly as they were.
        const Fp8Geometry g = Fp8Geometry::Of(l.fp8_recipe, n, t.shape);
        const bool mx = l.fp8_recipe == Fp8Recipe::kMxfp8;
        add("scale_inv", ".scale_inv", mx ? "U8" : "F32", g.ScaleBytes(),
            t.scale_inv.data);
        out.back().numel = g.Units();
        out.back().shape = {g.Units() / g.UnitColumns(), g.UnitColumns()};
      }
      if (l.master == MasterKind::kFp32) {
        add("master", ".master", "F32", n * 4, t.master.data());
      } else if (l.master == MasterKind::kRemainder) {
        add("remainder", ".remainder", "I16", n * 2, t.master.data());
      }
      if (t.frozen) continue;
      const uint64_t mb = n * DTypeSize(l.moment_dtype);
      const char* md = SafetensorsDType(l.moment_dtype);
      for (int slot = 0; slot < l.state_slots; ++slot) {
        // Slot names are string literals (core/optimizer.cc), so data() is
        // a terminated string that lives as long as the program.
        const absl::string_view kind = StateSlotName(l.optimizer, slot);
        add(kind.data(), absl::StrCat(".", kind), md, mb, t.state[slot].data());
        if (l.block8()) out.back().block8_slot = slot;
      }
      if (l.block8() && n > 0) {
        // One fp32 scale per block and slot (core/block8.h), saved as the
        // [blocks, slots] array the daemon holds.
        add("moment_scales", ".moment_scales", "F32", l.ScaleBytes(n),
            t.scales.data());
        out.back().numel = Block8Blocks(n) * l.state_slots;
        out.back().shape = {Block8Blocks(n), l.state_slots};
      }
    }
  }
  return out;
}

// Orders the pieces as the file holds them and sets their keys and
// offsets: tensor order with one key per piece, or (packed) grouped by
// group, kind and dtype, tensor order within each.
void Arrange(std::vector<Entry>& entries, bool packed) {
  for (Entry& e : entries) {
    e.key =
        packed ? absl::StrCat("g", e.group, ".", e.kind, ".", e.dtype) : e.name;
  }
  if (packed) {
    std::stable_sort(
        entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
          return a.group != b.group ? a.group < b.group : a.key < b.key;
        });
  }
  uint64_t offset = 0;
  for (Entry& e : entries) {
    e.offset = offset;
    offset += e.bytes;
  }
}

// True when piece `i` starts (ends) its file tensor.
bool RunStarts(const std::vector<Entry>& e, size_t i) {
  return i == 0 || e[i - 1].key != e[i].key;
}
bool RunEnds(const std::vector<Entry>& e, size_t i) {
  return i + 1 == e.size() || e[i + 1].key != e[i].key;
}

// Whether a save uses the packed format: when the per-tensor header could
// come near the header limit. The estimate errs high (a per-tensor entry
// costs its key twice, once with its crc, plus about 100 bytes; a tensor
// about 250 bytes of metadata besides its name), so a per-tensor header it
// lets through always fits.
bool UsePacked(const std::vector<Entry>& entries,
               const std::vector<Group*>& groups, uint64_t threshold) {
  uint64_t estimate = 0;
  for (const Entry& e : entries) estimate += 2 * e.name.size() + 130;
  for (const Group* g : groups) {
    for (const TensorEntry& t : g->tensors) {
      estimate += t.name.size() + 260;
      // The group's "aliases" entry of the tensor: its index and brackets,
      // and each alias quoted (twice escaped: the metadata is a JSON string
      // inside the header's JSON).
      if (!t.aliases.empty()) estimate += 32;
      for (const std::string& a : t.aliases) estimate += a.size() + 16;
      // Its "shards" entry: index, brackets, two numbers per dimension.
      if (!t.global_shape.empty()) estimate += 32 + 42 * t.global_shape.size();
    }
  }
  return estimate > threshold;
}

json HyperJson(const OptimizerHyper& h) {
  return json{{"optimizer", std::string(OptimizerName(h.kind))},
              {"lr", h.lr},
              {"beta1", h.beta1},
              {"beta2", h.beta2},
              {"eps", h.eps},
              {"weight_decay", h.weight_decay},
              {"adamw", h.adamw},
              {"bias_correction", h.bias_correction},
              {"maximize", h.maximize},
              {"amsgrad", h.amsgrad},
              {"momentum", h.momentum},
              {"dampening", h.dampening},
              {"nesterov", h.nesterov}};
}

// The names of the layout's state slots, in slot order, so that a reader
// needs no table of each optimizer's slots.
json SlotNamesJson(const Layout& l) {
  json names = json::array();
  for (int slot = 0; slot < l.state_slots; ++slot) {
    names.push_back(std::string(StateSlotName(l.optimizer, slot)));
  }
  return names;
}

json LayoutJson(const Layout& l) {
  json j{{"param_dtype", std::string(DTypeName(l.param_dtype))},
         {"grad_dtype", std::string(DTypeName(l.grad_dtype))},
         {"moment_dtype", std::string(DTypeName(l.moment_dtype))},
         {"master", std::string(MasterKindName(l.master))},
         {"optimizer", std::string(OptimizerName(l.optimizer))},
         {"state_slots", l.state_slots},
         {"slot_names", SlotNamesJson(l)},
         {"amsgrad", l.amsgrad()}};
  // Only FP8 parameters name a recipe, so other layouts read as before.
  if (l.fp8_recipe != Fp8Recipe::kNone) {
    j["fp8_recipe"] = std::string(Fp8RecipeName(l.fp8_recipe));
  }
  return j;
}

std::string CrcHex(uint32_t crc) {
  char buf[9];
  std::snprintf(buf, sizeof(buf), "%08x", crc);
  return buf;
}

// One tensor's metadata in the packed format: [name, numel, index into
// "layouts", flags (1: frozen, 2: keep_fp32)], and its shape as a fifth
// element when it has more than one dimension.
json PackedTensorJson(const TensorEntry& t, json& layouts) {
  const json layout = LayoutJson(t.layout);
  size_t index = 0;
  while (index < layouts.size() && layouts[index] != layout) ++index;
  if (index == layouts.size()) layouts.push_back(layout);
  json out = json::array(
      {t.name, t.numel, index, (t.frozen ? 1 : 0) | (t.keep_fp32 ? 2 : 0)});
  if (t.shape.size() > 1) out.push_back(t.shape);
  return out;
}

// A group's aliases in its metadata: [tensor index, [alias, ...]] pairs,
// only for tensors that have aliases (most groups have none, and then the
// key is left out).
json AliasesJson(const Group& g) {
  json out = json::array();
  for (size_t i = 0; i < g.tensors.size(); ++i) {
    if (!g.tensors[i].aliases.empty()) {
      out.push_back(json::array({i, g.tensors[i].aliases}));
    }
  }
  return out;
}

// A group's shards in its metadata: [tensor index, global shape, global
// offset] triples, only for tensors registered as shards of larger ones
// (TensorSpec::global_shape), so that tools can put every rank's shards
// together; the key is left out when there are none.
json ShardsJson(const Group& g) {
  json out = json::array();
  for (size_t i = 0; i < g.tensors.size(); ++i) {
    const TensorEntry& t = g.tensors[i];
    if (!t.global_shape.empty()) {
      out.push_back(json::array({i, t.global_shape, t.global_offset}));
    }
  }
  return out;
}

// The checkpoint's metadata, without the crc32c values: version 1 (a
// tensor's metadata as an object) or, packed, version 2 (as an array, its
// layout an index into one table).
json MetaJson(const std::vector<Group*>& groups, bool packed,
              const std::string& job_id) {
  json meta;
  meta["format_version"] = packed ? 2 : 1;
  meta["job_id"] = job_id;
  json layouts = json::array();
  json jgroups = json::array();
  for (const Group* g : groups) {
    json jg;
    jg["id"] = g->id;
    jg["step"] = g->step;
    jg["hyperparameters"] = HyperJson(g->hyper);
    json jt = json::array();
    for (const TensorEntry& t : g->tensors) {
      if (packed) {
        jt.push_back(PackedTensorJson(t, layouts));
        continue;
      }
      jt.push_back(json{{"name", t.name},
                        {"numel", t.numel},
                        {"frozen", t.frozen},
                        {"keep_fp32", t.keep_fp32},
                        {"layout", LayoutJson(t.layout)}});
    }
    jg["tensors"] = jt;
    // Tensors that missed steps without a gradient: [index, missed] pairs,
    // only where nonzero (most groups have none).
    json missed = json::array();
    for (size_t i = 0; i < g->tensors.size(); ++i) {
      if (g->tensors[i].missed_steps > 0) {
        missed.push_back(json::array({i, g->tensors[i].missed_steps}));
      }
    }
    if (!missed.empty()) jg["missed_steps"] = missed;
    json aliases = AliasesJson(*g);
    if (!aliases.empty()) jg["aliases"] = std::move(aliases);
    json shards = ShardsJson(*g);
    if (!shards.empty()) jg["shards"] = std::move(shards);
    jgroups.push_back(jg);
  }
  meta["groups"] = jgroups;
  if (packed) meta["layouts"] = layouts;
  return meta;
}

// The full header JSON (crc values are fixed-width, so the length does not
// depend on them): one safetensors tensor per run of pieces with one key.
std::string HeaderJson(json meta, const std::vector<Entry>& entries) {
  json crcs = json::object();
  json tensors = json::object();
  uint64_t begin = 0, numel = 0;
  for (size_t i = 0; i < entries.size(); ++i) {
    const Entry& e = entries[i];
    if (RunStarts(entries, i)) {
      begin = e.offset;
      numel = 0;
    }
    numel += e.numel;
    if (!RunEnds(entries, i)) continue;
    crcs[e.key] = CrcHex(e.crc);
    // A piece alone in its file tensor (the per-tensor format) has its
    // tensor's shape; a packed run is 1-D.
    const bool alone = RunStarts(entries, i) && !e.shape.empty();
    tensors[e.key] =
        json{{"dtype", e.dtype},
             {"shape", alone ? json(e.shape) : json::array({numel})},
             {"data_offsets", json::array({begin, e.offset + e.bytes})}};
  }
  meta["crc32c"] = std::move(crcs);
  // The metadata's own checksum: a damaged step counter or learning rate
  // would otherwise load silently (the data checksums do not cover it).
  const std::string meta_text = meta.dump();
  tensors["__metadata__"] =
      json{{"optimd", meta_text},
           {"optimd_crc32c",
            CrcHex(Crc32cExtend(0, meta_text.data(), meta_text.size()))}};
  std::string s = tensors.dump();
  // Pad so that the data section starts 8-byte aligned.
  while ((8 + s.size()) % 8 != 0) s.push_back(' ');
  return s;
}

// A header past the limit would make a file that LoadState (and the
// safetensors library) refuses: refused before anything is written.
absl::Status CheckHeaderSize(const std::string& header) {
  if (header.size() <= kMaxCheckpointHeaderBytes) return absl::OkStatus();
  return absl::ResourceExhaustedError(
      absl::StrCat("the checkpoint header would be ", header.size(),
                   " bytes, more than the ", kMaxCheckpointHeaderBytes,
                   " safetensors readers accept; nothing was written and the "
                   "previous checkpoint is intact. Use shorter tensor names "
                   "or fewer tensors per session"));
}

}  // namespace checkpoint_header
}  // namespace optimd
