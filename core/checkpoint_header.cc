#include "core/checkpoint_header.h"

#include <algorithm>
#include <cstdio>
#include <string_view>
#include <unordered_set>

#include "absl/strings/str_cat.h"
#include "common/crc32c.h"
#include "common/status_macros.h"
#include "core/block8.h"
#include "core/checkpoint.h"

// Helpers not declared in the header live in this namespace too: the
// file's functions call each other in both directions.
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

json LayoutJson(const Layout& l) {
  json j{{"param_dtype", std::string(DTypeName(l.param_dtype))},
         {"grad_dtype", std::string(DTypeName(l.grad_dtype))},
         {"moment_dtype", std::string(DTypeName(l.moment_dtype))},
         {"master", std::string(MasterKindName(l.master))},
         {"optimizer", std::string(OptimizerName(l.optimizer))},
         {"state_slots", l.state_slots},
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

// A packed tensor's optional shape: at most 64 non-negative integers whose
// product is `numel`.
bool IsShapeOf(const json& shape, uint64_t numel) {
  if (!shape.is_array() || shape.size() > 64) return false;
  uint64_t product = 1;
  for (const json& d : shape) {
    if (!d.is_number_unsigned() ||
        __builtin_mul_overflow(product, d.get<uint64_t>(), &product)) {
      return false;
    }
  }
  return product == numel;
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

// ---- Reading an untrusted header ----
// A checkpoint can come from anywhere (a file, a client's stream): every
// header field is checked for presence, type and range before it is used,
// and every problem is a Status naming the field, never an exception.

// Deeper nesting is refused before parsing, so that no recursive walk over
// a parsed value (comparison, printing, destruction) can exhaust the stack.
constexpr int kMaxJsonDepth = 16;

absl::Status Malformed(const std::string& path, const std::string& what) {
  return absl::InvalidArgumentError(
      absl::StrCat(path, " has a malformed optimd header: ", what,
                   "; the file is damaged or was not written by optimd"));
}

absl::Status CheckJsonDepth(absl::string_view text, const std::string& path) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > kMaxJsonDepth) {
        return Malformed(path, absl::StrCat("JSON nested deeper than ",
                                            kMaxJsonDepth, " levels"));
      }
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return absl::OkStatus();
}

// Parses untrusted JSON text without throwing.
absl::StatusOr<json> ParseJson(absl::string_view text, const std::string& path,
                               const std::string& what) {
  OPTIMD_RETURN_IF_ERROR(CheckJsonDepth(text, path));
  json j = json::parse(text.begin(), text.end(), nullptr,
                       /*allow_exceptions=*/false);
  if (j.is_discarded()) return Malformed(path, what + " is not valid JSON");
  return j;
}

// Typed access to the members of one JSON object of a header.
class Fields {
 public:
  // INVALID_ARGUMENT unless `j` is an object.
  static absl::StatusOr<Fields> Of(const json& j, std::string where,
                                   const std::string& path) {
    if (!j.is_object()) return Malformed(path, where + " is not an object");
    return Fields(j, std::move(where), path);
  }

  const std::string& where() const { return where_; }

  absl::StatusOr<const json*> Get(const char* key) const {
    auto it = obj_.find(key);
    if (it == obj_.end()) return Bad(key, "missing");
    return &*it;
  }
  absl::StatusOr<uint64_t> Uint(const char* key) const {
    OPTIMD_ASSIGN_OR_RETURN(const json* v, Get(key));
    if (v->is_number_unsigned()) return v->get<uint64_t>();
    if (v->is_number_integer() && v->get<int64_t>() >= 0) {
      return static_cast<uint64_t>(v->get<int64_t>());
    }
    return Bad(key, "not a non-negative integer");
  }
  absl::StatusOr<double> Number(const char* key) const {
    OPTIMD_ASSIGN_OR_RETURN(const json* v, Get(key));
    if (!v->is_number()) return Bad(key, "not a number");
    return v->get<double>();
  }
  absl::StatusOr<bool> Bool(const char* key) const {
    OPTIMD_ASSIGN_OR_RETURN(const json* v, Get(key));
    if (!v->is_boolean()) return Bad(key, "not true or false");
    return v->get<bool>();
  }
  absl::StatusOr<std::string> String(const char* key) const {
    OPTIMD_ASSIGN_OR_RETURN(const json* v, Get(key));
    if (!v->is_string()) return Bad(key, "not a string");
    return v->get<std::string>();
  }
  absl::StatusOr<const json*> Array(const char* key) const {
    OPTIMD_ASSIGN_OR_RETURN(const json* v, Get(key));
    if (!v->is_array()) return Bad(key, "not an array");
    return v;
  }
  // An array of exactly `n` non-negative integers.
  absl::StatusOr<std::vector<uint64_t>> Uints(const char* key, size_t n) const {
    OPTIMD_ASSIGN_OR_RETURN(const json* v, Array(key));
    std::vector<uint64_t> out;
    for (const json& x : *v) {
      if (!x.is_number_unsigned()) break;
      out.push_back(x.get<uint64_t>());
    }
    if (out.size() != n || v->size() != n) {
      return Bad(key, absl::StrCat("not ", n, " non-negative integers"));
    }
    return out;
  }
  // The product of a shape: an array of at most 64 non-negative integers
  // (a tensor's shape; its product must not overflow).
  absl::StatusOr<uint64_t> ShapeNumel(const char* key) const {
    OPTIMD_ASSIGN_OR_RETURN(const json* v, Array(key));
    uint64_t product = 1;
    bool bad = v->size() > 64;
    for (const json& d : *v) {
      bad = bad || !d.is_number_unsigned() ||
            __builtin_mul_overflow(product, d.get<uint64_t>(), &product);
    }
    if (bad) return Bad(key, "not a shape (at most 64 dimensions)");
    return product;
  }
  absl::Status Bad(const char* key, const std::string& problem) const {
    return Malformed(path_,
                     absl::StrCat(where_, " field '", key, "' is ", problem));
  }

 private:
  Fields(const json& obj, std::string where, const std::string& path)
      : obj_(obj), where_(std::move(where)), path_(path) {}
  const json& obj_;
  std::string where_;
  std::string path_;
};

// A crc32c written as 8 lowercase hex digits.
absl::StatusOr<uint32_t> ParseCrcHex(const std::string& s) {
  uint32_t v = 0;
  for (char c : s) {
    int d = c >= '0' && c <= '9'   ? c - '0'
            : c >= 'a' && c <= 'f' ? c - 'a' + 10
                                   : -1;
    if (d < 0) return absl::InvalidArgumentError("not hex");
    v = v << 4 | static_cast<uint32_t>(d);
  }
  if (s.size() != 8) return absl::InvalidArgumentError("not 8 digits");
  return v;
}

// The optional "missed_steps" of a group: [tensor index, missed] pairs, each
// index once and below `tensors`, each count at most the group's step.
absl::StatusOr<std::vector<uint64_t>> ParseMissedSteps(const json& jg,
                                                       const Fields& f,
                                                       uint64_t step,
                                                       size_t tensors) {
  std::vector<uint64_t> missed(tensors, 0);
  if (!jg.contains("missed_steps")) return missed;
  OPTIMD_ASSIGN_OR_RETURN(const json* pairs, f.Array("missed_steps"));
  for (const json& p : *pairs) {
    if (!p.is_array() || p.size() != 2 || !p[0].is_number_unsigned() ||
        !p[1].is_number_unsigned() || p[0].get<uint64_t>() >= tensors ||
        p[1].get<uint64_t>() == 0 || p[1].get<uint64_t>() > step ||
        missed[p[0].get<size_t>()] != 0) {
      return f.Bad(
          "missed_steps",
          absl::StrCat("not a list of distinct [tensor index < ", tensors,
                       ", 1 <= missed <= step ", step, "] pairs"));
    }
    missed[p[0].get<size_t>()] = p[1].get<uint64_t>();
  }
  return missed;
}

// The names a file's aliases must not repeat: its tensor names (which
// ParseGroup has matched with the registered ones) and the aliases read so
// far. The tensor names are indexed on the first alias only, so that a
// file without aliases costs nothing more to load.
class FileNames {
 public:
  explicit FileNames(const std::vector<Group*>& groups) : groups_(groups) {}

  // Takes `alias`; false when it is a tensor name or was taken before.
  bool Take(const std::string& alias) {
    if (!indexed_) {
      for (const Group* g : groups_) {
        for (const TensorEntry& t : g->tensors) tensor_names_.insert(t.name);
      }
      indexed_ = true;
    }
    return tensor_names_.count(alias) == 0 && aliases_.insert(alias).second;
  }

 private:
  const std::vector<Group*>& groups_;
  bool indexed_ = false;
  std::unordered_set<std::string_view> tensor_names_;
  std::unordered_set<std::string> aliases_;
};

// The optional "aliases" of a group: [tensor index, [alias, ...]] pairs,
// each index once and below `tensors`, each with 1 to kMaxAliasesPerTensor
// aliases of 1 to kMaxNameBytes bytes, none a tensor name of the file or
// another alias in it. Per tensor, its aliases (empty without the key).
absl::StatusOr<std::vector<std::vector<std::string>>> ParseAliases(
    const json& jg, const Fields& f, size_t tensors, FileNames* names) {
  std::vector<std::vector<std::string>> out(tensors);
  if (!jg.contains("aliases")) return out;
  OPTIMD_ASSIGN_OR_RETURN(const json* pairs, f.Array("aliases"));
  for (const json& p : *pairs) {
    if (!p.is_array() || p.size() != 2 || !p[0].is_number_unsigned() ||
        p[0].get<uint64_t>() >= tensors || !p[1].is_array() || p[1].empty() ||
        p[1].size() > kMaxAliasesPerTensor ||
        !out[p[0].get<size_t>()].empty()) {
      return f.Bad(
          "aliases",
          absl::StrCat("not a list of distinct [tensor index < ", tensors,
                       ", [1 to ", kMaxAliasesPerTensor, " names]] pairs"));
    }
    std::vector<std::string>& mine = out[p[0].get<size_t>()];
    for (const json& a : p[1]) {
      if (!a.is_string() || a.get_ref<const std::string&>().empty() ||
          a.get_ref<const std::string&>().size() > kMaxNameBytes) {
        return f.Bad("aliases", absl::StrCat("listing an alias that is not a "
                                             "string of 1 to ",
                                             kMaxNameBytes, " bytes"));
      }
      const std::string& alias = a.get_ref<const std::string&>();
      if (!names->Take(alias)) {
        return f.Bad("aliases", absl::StrCat("listing '", alias.substr(0, 64),
                                             "', a tensor name or an alias "
                                             "listed before"));
      }
      mine.push_back(alias);
    }
  }
  return out;
}

absl::StatusOr<OptimizerHyper> ParseHyper(const Fields& g,
                                          const std::string& path) {
  OPTIMD_ASSIGN_OR_RETURN(const json* jh, g.Get("hyperparameters"));
  OPTIMD_ASSIGN_OR_RETURN(
      Fields h, Fields::Of(*jh, g.where() + " hyperparameters", path));
  OptimizerHyper out;
  OPTIMD_ASSIGN_OR_RETURN(out.lr, h.Number("lr"));
  OPTIMD_ASSIGN_OR_RETURN(out.beta1, h.Number("beta1"));
  OPTIMD_ASSIGN_OR_RETURN(out.beta2, h.Number("beta2"));
  OPTIMD_ASSIGN_OR_RETURN(out.eps, h.Number("eps"));
  OPTIMD_ASSIGN_OR_RETURN(out.weight_decay, h.Number("weight_decay"));
  OPTIMD_ASSIGN_OR_RETURN(out.adamw, h.Bool("adamw"));
  OPTIMD_ASSIGN_OR_RETURN(out.bias_correction, h.Bool("bias_correction"));
  OPTIMD_ASSIGN_OR_RETURN(out.maximize, h.Bool("maximize"));
  OPTIMD_ASSIGN_OR_RETURN(out.amsgrad, h.Bool("amsgrad"));
  // Files written before optimizers other than AdamW have none of these.
  if (jh->contains("optimizer")) {
    OPTIMD_ASSIGN_OR_RETURN(std::string name, h.String("optimizer"));
    auto kind = OptimizerFromName(name);
    if (!kind.ok()) return h.Bad("optimizer", "not a known optimizer");
    out.kind = *kind;
    OPTIMD_ASSIGN_OR_RETURN(out.momentum, h.Number("momentum"));
    OPTIMD_ASSIGN_OR_RETURN(out.dampening, h.Number("dampening"));
    OPTIMD_ASSIGN_OR_RETURN(out.nesterov, h.Bool("nesterov"));
  }
  absl::Status s = CheckHyperparameters(out, g.where());
  if (!s.ok()) return Malformed(path, std::string(s.message()));
  return out;
}

// Whether a header's layout is `l`. Files written before optimizers other
// than AdamW name neither the optimizer nor the slot count: such a layout
// is an AdamW one.
bool LayoutMatches(const json& file, const Layout& l) {
  json mine = LayoutJson(l);
  if (file.is_object() && !file.contains("optimizer") &&
      l.optimizer == OptimizerKind::kAdamW) {
    mine.erase("optimizer");
    mine.erase("state_slots");
  }
  return file == mine;
}

// One tensor's metadata as a header gives it.
struct TensorHeader {
  std::string name;
  uint64_t numel = 0;
  bool frozen = false;
  const json* layout = nullptr;
};

// Version 1: {"name", "numel", "frozen", "keep_fp32", "layout"}.
absl::StatusOr<TensorHeader> ParseTensor(const json& j,
                                         const std::string& where,
                                         const std::string& path) {
  OPTIMD_ASSIGN_OR_RETURN(Fields f, Fields::Of(j, where, path));
  TensorHeader t;
  OPTIMD_ASSIGN_OR_RETURN(t.name, f.String("name"));
  OPTIMD_ASSIGN_OR_RETURN(t.numel, f.Uint("numel"));
  OPTIMD_ASSIGN_OR_RETURN(t.frozen, f.Bool("frozen"));
  OPTIMD_ASSIGN_OR_RETURN(t.layout, f.Get("layout"));
  return t;
}

// Version 2 (packed): [name, numel, layout index, flags(, shape)].
absl::StatusOr<TensorHeader> ParsePackedTensor(const json& j,
                                               const json& layouts,
                                               const std::string& where,
                                               const std::string& path) {
  if (!j.is_array() || (j.size() != 4 && j.size() != 5) || !j[0].is_string() ||
      !j[1].is_number_unsigned() || !j[2].is_number_unsigned() ||
      !j[3].is_number_unsigned() || j[2].get<uint64_t>() >= layouts.size() ||
      j[3].get<uint64_t>() > 3 ||
      (j.size() == 5 && !IsShapeOf(j[4], j[1].get<uint64_t>()))) {
    return Malformed(path, where + " is not [name, numel, layout index < " +
                               std::to_string(layouts.size()) +
                               ", flags(, shape holding numel)]");
  }
  TensorHeader t;
  t.name = j[0].get<std::string>();
  t.numel = j[1].get<uint64_t>();
  t.frozen = (j[3].get<uint64_t>() & 1) != 0;
  t.layout = &layouts[j[2].get<size_t>()];
  return t;
}

// Checks one group of the header against the registered group `g`.
// `layouts`: the packed format's layout table; null for version 1.
// `names`: the file's tensor names and the aliases of earlier groups.
absl::StatusOr<GroupHeader> ParseGroup(const json& jg, const Group& g,
                                       size_t index, const json* layouts,
                                       FileNames* names,
                                       const std::string& path) {
  OPTIMD_ASSIGN_OR_RETURN(Fields f,
                          Fields::Of(jg, absl::StrCat("group ", index), path));
  OPTIMD_ASSIGN_OR_RETURN(std::string id, f.String("id"));
  if (id != g.id) {
    return absl::FailedPreconditionError(
        absl::StrCat("group ", index, " is '", id.substr(0, kMaxNameBytes),
                     "' in ", path, " but '", g.id, "' in the session"));
  }
  GroupHeader out;
  OPTIMD_ASSIGN_OR_RETURN(out.step, f.Uint("step"));
  if (out.step > kMaxStepCounter) {
    return f.Bad(
        "step", absl::StrCat(out.step, ", past the largest ", kMaxStepCounter));
  }
  OPTIMD_ASSIGN_OR_RETURN(out.hyper, ParseHyper(f, path));
  OPTIMD_ASSIGN_OR_RETURN(const json* jt, f.Array("tensors"));
  if (jt->size() != g.tensors.size()) {
    return absl::FailedPreconditionError(
        absl::StrCat("group '", g.id, "' has ", jt->size(), " tensors in ",
                     path, " but ", g.tensors.size(), " registered"));
  }
  OPTIMD_ASSIGN_OR_RETURN(out.missed,
                          ParseMissedSteps(jg, f, out.step, g.tensors.size()));
  for (size_t ti = 0; ti < g.tensors.size(); ++ti) {
    const TensorEntry& t = g.tensors[ti];
    const std::string where =
        absl::StrCat("tensor ", ti, " of group '", g.id, "'");
    OPTIMD_ASSIGN_OR_RETURN(
        TensorHeader th,
        layouts == nullptr
            ? ParseTensor((*jt)[ti], where, path)
            : ParsePackedTensor((*jt)[ti], *layouts, where, path));
    if (th.name != t.name || th.numel != t.numel || th.frozen != t.frozen ||
        !LayoutMatches(*th.layout, t.layout)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "tensor '", t.name, "' (group '", g.id, "') does not match ", path,
          ": the file has '", th.name.substr(0, kMaxNameBytes), "' with ",
          th.numel, " elements, layout ", th.layout->dump(), "; registered: ",
          t.numel, " elements, layout ", LayoutJson(t.layout).dump()));
    }
  }
  OPTIMD_ASSIGN_OR_RETURN(out.aliases,
                          ParseAliases(jg, f, g.tensors.size(), names));
  return out;
}

// Checks the safetensors tensor of the run of pieces [first, end) (one
// key) and sets the pieces' offsets and the run's crc (on its last piece).
absl::Status ParseRun(const json& h, const json& crcs,
                      std::vector<Entry>& entries, size_t first, size_t end,
                      uint64_t data_bytes, const std::string& path) {
  const std::string& key = entries[first].key;
  uint64_t numel = 0, bytes = 0;
  for (size_t i = first; i < end; ++i) {
    numel += entries[i].numel;
    bytes += entries[i].bytes;
  }
  auto it = h.find(key);
  if (it == h.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, " has no tensor '", key, "'"));
  }
  OPTIMD_ASSIGN_OR_RETURN(
      Fields f, Fields::Of(*it, absl::StrCat("tensor '", key, "'"), path));
  OPTIMD_ASSIGN_OR_RETURN(std::string dtype, f.String("dtype"));
  OPTIMD_ASSIGN_OR_RETURN(uint64_t shape_numel, f.ShapeNumel("shape"));
  OPTIMD_ASSIGN_OR_RETURN(std::vector<uint64_t> offsets,
                          f.Uints("data_offsets", 2));
  if (dtype != entries[first].dtype || shape_numel != numel ||
      offsets[1] < offsets[0] || offsets[1] - offsets[0] != bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor '", key, "' in ", path, " is ", it->dump(), "; expected dtype ",
        entries[first].dtype, " shape [", numel, "] (", bytes, " bytes)"));
  }
  if (offsets[1] > data_bytes) {
    return absl::DataLossError(absl::StrCat(path, " is truncated: tensor '",
                                            key, "' ends at data byte ",
                                            offsets[1], " of ", data_bytes));
  }
  uint64_t offset = offsets[0];
  for (size_t i = first; i < end; ++i) {
    entries[i].offset = offset;
    entries[i].crc = 0;
    offset += entries[i].bytes;
  }
  auto c = crcs.find(key);
  if (c == crcs.end() || !c->is_string()) {
    return Malformed(path,
                     absl::StrCat("no crc32c string for tensor '", key, "'"));
  }
  auto crc = ParseCrcHex(c->get<std::string>());
  if (!crc.ok()) {
    return Malformed(path, absl::StrCat("the crc32c of tensor '", key, "' is ",
                                        crc.status().message()));
  }
  entries[end - 1].crc = *crc;
  return absl::OkStatus();
}

// Parses and checks a whole header against the registered groups, setting
// the entries' offsets and checksums. Changes no state.
absl::StatusOr<std::vector<GroupHeader>> ParseHeader(
    const std::string& header, const std::vector<Group*>& groups,
    std::vector<Entry>& entries, uint64_t data_bytes, const std::string& path) {
  OPTIMD_ASSIGN_OR_RETURN(json h, ParseJson(header, path, "the header"));
  auto not_ours = [&](const std::string& why) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, " is not an optimd checkpoint (", why, ")"));
  };
  if (!h.is_object()) return not_ours("the header is not a JSON object");
  auto md = h.find("__metadata__");
  if (md == h.end() || !md->is_object()) return not_ours("no __metadata__");
  auto text = md->find("optimd");
  if (text == md->end() || !text->is_string()) {
    return not_ours("no __metadata__.optimd string");
  }
  const std::string& meta_text = text->get_ref<const std::string&>();
  OPTIMD_ASSIGN_OR_RETURN(json meta, ParseJson(meta_text, path, "metadata"));
  OPTIMD_ASSIGN_OR_RETURN(Fields m, Fields::Of(meta, "the metadata", path));
  OPTIMD_ASSIGN_OR_RETURN(uint64_t version, m.Uint("format_version"));
  if (version > kCheckpointFormatVersion || version == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, " has checkpoint format version ", version,
        "; this daemon reads versions 1 to ", kCheckpointFormatVersion,
        " (written by a newer optimd?)"));
  }
  // The version first: a newer format may checksum differently.
  if (auto mc = md->find("optimd_crc32c"); mc != md->end()) {
    auto want = mc->is_string() ? ParseCrcHex(mc->get<std::string>())
                                : absl::InvalidArgumentError("not a string");
    if (!want.ok() ||
        *want !=
            Crc32cExtend(0, reinterpret_cast<const uint8_t*>(meta_text.data()),
                         meta_text.size())) {
      return absl::DataLossError(
          absl::StrCat("the metadata of ", path,
                       " does not match its crc32c: the header is corrupt"));
    }
  }
  OPTIMD_ASSIGN_OR_RETURN(const json* jgroups, m.Array("groups"));
  if (jgroups->size() != groups.size()) {
    return absl::FailedPreconditionError(absl::StrCat(
        path, " holds ", jgroups->size(), " groups; the session has ",
        groups.size(), " registered"));
  }
  const bool packed = version == 2;
  const json* layouts = nullptr;
  if (packed) {
    OPTIMD_ASSIGN_OR_RETURN(layouts, m.Array("layouts"));
  }
  std::vector<GroupHeader> out;
  FileNames names(groups);
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    OPTIMD_ASSIGN_OR_RETURN(
        GroupHeader g,
        ParseGroup((*jgroups)[gi], *groups[gi], gi, layouts, &names, path));
    out.push_back(std::move(g));
  }
  OPTIMD_ASSIGN_OR_RETURN(const json* crcs, m.Get("crc32c"));
  if (!crcs->is_object()) return m.Bad("crc32c", "not an object");
  Arrange(entries, packed);
  for (size_t first = 0; first < entries.size();) {
    size_t end = first + 1;
    while (!RunEnds(entries, end - 1)) ++end;
    OPTIMD_RETURN_IF_ERROR(
        ParseRun(h, *crcs, entries, first, end, data_bytes, path));
    first = end;
  }
  return out;
}

}  // namespace checkpoint_header
}  // namespace optimd
